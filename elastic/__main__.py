from elastic.cli import main

raise SystemExit(main())
