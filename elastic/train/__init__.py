"""Training: the world of replicas and its DiLoCo outer loop, one rank's actor, the outer sync's codecs, data, metrics, export."""
