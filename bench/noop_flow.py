"""A Prefect flow that does nothing: its wall time is Prefect's fixed cost per process.

`python -m bench.noop_flow`. Run without PREFECT_API_URL it pays the embedded
API's start-up; against a running server it does not. The difference of the
two medians is the start-up the `*_no_startup` figures leave out.
"""

from prefect import flow


@flow(name="kiln-bench-noop")
def noop() -> int:
    return 0


if __name__ == "__main__":
    noop()
