"""The service tests start real daemons through `stepahead.launcher`."""

from stepahead.launcher import ServeProcess as Serve

__all__ = ["Serve"]
