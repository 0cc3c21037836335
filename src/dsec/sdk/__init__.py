"""The Python SDK: one async implementation (``aio``) and the sync API derived from it (``sync``)."""
