"""kdacp: context-parallel state exchange of Kimi Delta Attention.

The protocols, kernels and the KDA layer are C++ (kdacp._kdacp); kdacp.torch
runs them on torch tensors over a torch.distributed process group:

    import kdacp.torch as kt

docs/python.md describes the API, its errors and how split is done.
"""

from kdacp._kdacp import Error, InvalidArgument, IoError, RemoteError, Timeout, defaults, exchange_methods

__all__ = ["Error", "InvalidArgument", "IoError", "RemoteError", "Timeout", "defaults", "exchange_methods"]
__version__ = "0.1.0"
