"""Passes over a finished :class:`fwdtrace.Graph`: drawing now, more as they come."""
