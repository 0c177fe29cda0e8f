"""The `aws` provider: EC2 VMs (`provider.py`), its recipe section (`config.py`), S3
(`storage.py`) and the node watcher's notice poller (`watcher.py`)."""
