"""What the runtime keeps of the quality testbed: the procedural I2V workload (``workload``, used by
the Chorus Testbed Request node) and the random tiny Wan2.1-I2V model (``tiny_wan``, for checking an
install and for the tests). The research harness (training, the reports, the product-path harness,
the quality table, the pictures) lives in ``tests/testbed/``; nothing in the runtime imports it."""
