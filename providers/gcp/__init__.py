"""The `gcp` provider: Compute Engine VMs (`provider.py`), its recipe section (`config.py`),
Cloud Storage (`storage.py`), the node watcher's notice poller (`watcher.py`), and what their
calls to Google Cloud share (`api.py`: endpoints, credentials, label values)."""
