"""Moved to :mod:`fcdp_deepspeed.tools.cluster`; this old path stays an alias of it."""
from fcdp_deepspeed.tools._alias import alias

alias(__name__, "fcdp_deepspeed.tools.cluster")
