"""The service tests start real daemons through `testing.launcher`."""

from testing.launcher import ServeProcess as Serve

__all__ = ["Serve"]
