"""Serving benchmark (Poisson arrivals, latency percentiles, offline comparison).

The code lives in service/bench.py so `tandem bench` runs the same thing:

    .venv/bin/python benchmarks/serving_bench.py --rates 1,2,inf --num-requests 64
"""

from __future__ import annotations

import argparse
import sys

from service import bench


def main() -> int:
    parser = argparse.ArgumentParser(
        description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    bench.add_arguments(parser)
    return bench.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
