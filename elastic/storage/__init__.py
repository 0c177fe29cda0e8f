"""Where a run's bytes live: the stores behind s3://, gs:// and file://, and phased, sharded checkpoints on them."""
