"""Planning offload policies from what the machine measurably does (see ``calibrate``)."""
