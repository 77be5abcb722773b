"""The evidence harness: rerun every benchmark of raot_hf offline with one command.

``python -m benchmarks.run [--quick] [--out benchmarks/results]`` builds the model pairs
(:mod:`benchmarks.pairs`, trained reproducibly on data that ships inside installed packages and
cached by :mod:`benchmarks.zoo`), merges each pair with every method through the product's own
options (:mod:`benchmarks.methods`), measures it (:mod:`benchmarks.metrics`) and writes
``RESULTS.md``, ``results.json`` and plots (:mod:`benchmarks.report`). See ``benchmarks/README.md``.

``benchmarks/perf/`` (time and memory against the cost floor) is a separate script.
"""
