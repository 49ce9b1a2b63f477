"""`python -m dsv4ops` runs the demo; `python -m dsv4ops bench [...]` the benchmarks."""

import sys

if len(sys.argv) > 1 and sys.argv[1] == "bench":
    from dsv4ops.bench.cli import main

    main(sys.argv[2:])
else:
    from dsv4ops.bench.demo import main

    main(sys.argv[1:])
