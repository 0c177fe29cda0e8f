"""The `local` provider: Ray nodes on this machine priced by a simulated spot market
(`provider.py`), its recipe section (`config.py`) and its network lab (`localnet.py`)."""
