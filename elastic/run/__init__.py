"""One run: `elastic launch` and its driver loop, the driver's parts (offers, rentals, prices, pause), the local Ray cluster, preflight, the fleet commands and the driver's log."""
