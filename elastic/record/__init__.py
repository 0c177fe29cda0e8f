"""What a run records: every event type, the ledger they are appended to, and the one bill that prices it."""
