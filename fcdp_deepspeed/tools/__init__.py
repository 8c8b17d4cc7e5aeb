"""The user commands, beside a training job, never inside one.

The plugin core (every other room of the package) never imports this package (``tests/test_architecture.py``
checks it): a training process loads none of it.

- ``cli.py``: the ``fcdp`` command; ``args.py``: the argument checks every command shares;
- ``doctor.py``: ``fcdp doctor``; ``configs.py``: ``fcdp configs``; ``plan/``: ``fcdp plan``.

The bench, the demo, the emulated cluster and the other tools that measure FCDP live in the repository's lab
(``fcdp_lab/``, not installed).
"""
