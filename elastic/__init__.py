"""elastic: DiLoCo training on preemptible VMs across clouds, on Ray."""

__version__ = "0.1.0"
