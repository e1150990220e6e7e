"""How every fwdtrace tool attaches to a running model: keys and selectors, compiled models, hooks.

Probe, Dumper, the live sampler, the Recorder, ``analyze`` and chaos are clients of this
package: they say which keys they want, and it resolves them to modules and function sites
(the same keys on an eager, a ``torch.compile``'d and a regionally compiled model) and makes sure
their hooks run (:mod:`fwdtrace.instrument.compiled`).
"""
