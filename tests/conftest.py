import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)
