"""The VM lab: every instance the clouds' APIs start (moto's EC2, the local Compute Engine fake)
boots as a machine on this host, running the user-data / startup-script the provider sent
(`vmlab.VmLab`; `elastic rehearse` and tests/providers/test_vmlab.py use it). Needs root."""
