"""A parallel rank started by rank 0 on the same machine (see tiergen.parallel.group.launch)."""

from tiergen.parallel.group import worker_main

worker_main()
