"""Rental policies replayed on a price/preemption trace in simulated time, and the least any policy could pay on it."""
