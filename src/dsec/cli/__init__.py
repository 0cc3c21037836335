"""The ``dsec`` command line."""
