"""The research harness of the quality testbed: training (``train``), the mask-quality report
(``report``), sharpness, the probe runs, the product-path harness and the quality table over its
runs, and the pictures. Run from the repository root, e.g. ``python -m tests.testbed.product_path
--tiny --out DIR``. It moved here from ``chorus_core/testbed/``: a ComfyUI user installs the
runtime, and the runtime keeps only what the demo and the testbed request node need there (the
procedural workload, ``chorus_core.testbed.workload``, and the random tiny model,
``chorus_core.testbed.tiny_wan``). This folder also holds the testbed's checkpoints and records."""
