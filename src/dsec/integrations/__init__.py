"""Adapters that let other harnesses run on dsec, built on the SDK's public surface (``import dsec``).

Each is an optional extra (``pip install 'dsec[NAME]'``) and is imported only by those who use it:
nothing else in dsec imports this package.
"""
