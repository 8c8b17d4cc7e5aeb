"""How FCDP gets into a process and onto DeepSpeed: the top of the core.

- ``api.py``: ``install()``/``uninstall()`` (patch DeepSpeed's engine and stage-3 classes), ``get_stats``,
  comm counting; ``fcdp_deepspeed.install()`` calls it.
- ``autoload.py``, ``post_import.py``, ``version_gate.py`` (with ``deepspeed_releases.json``, the release
  table it reads): the startup path. The ``.pth`` startup hook imports them at every interpreter start, so
  they, and this ``__init__``, import nothing but the standard library (``tests/test_architecture.py``).
- ``excepthook.py``: one line per rank for a config error.
"""
