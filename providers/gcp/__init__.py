"""The `gcp` provider: Compute Engine VMs (`provider.py`), its recipe section (`config.py`),
Cloud Storage (`storage.py`) and the node watcher's notice poller (`watcher.py`)."""
