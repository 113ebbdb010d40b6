"""The service tests start real daemons through `stepahead.cli.launcher`."""

from stepahead.cli.launcher import ServeProcess as Serve

__all__ = ["Serve"]
