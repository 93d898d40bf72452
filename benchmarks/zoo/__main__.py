"""``python -m benchmarks.zoo``: K-FAC against its peers on the zoo (:mod:`benchmarks.zoo.run`)."""

from benchmarks.zoo.run import main

main()
