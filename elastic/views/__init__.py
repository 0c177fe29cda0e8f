"""Views of a run's ledger: the report (JSON and HTML), the live status, and the console's writer."""
