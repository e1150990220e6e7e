"""ONNX beside the trace: export it, say what each torch call becomes, compare the two, emit it.

The modules, each a separate pass over a recorded :class:`fwdtrace.Graph`:

- :mod:`fwdtrace.onnx.export`: ``export_onnx`` (torch.onnx with module scopes kept) and
  ``onnx_graph`` (an ONNX model read back as a fwdtrace Graph);
- :mod:`fwdtrace.onnx.ops`: the equivalences, what a torch layer or function becomes in ONNX
  (``onnx_equivalent`` registers more);
- :mod:`fwdtrace.onnx.compare`: ``compare_onnx`` / ``check_onnx``, the edge-by-edge diff;
- :mod:`fwdtrace.onnx.numeric`: ``check_onnx(numeric=True)``'s pass over that diff, each matched
  call's eager output against its ONNX value in onnxruntime (first divergence, repro);
- :mod:`fwdtrace.onnx.emit`: ``to_onnx`` (ONNX from one eager run, through torchlib) and
  ``onnx_symbolic`` (what torchlib does not cover).

The public names live on the top-level package (``fwdtrace.check_onnx``); importing this
package imports neither torch.onnx nor onnx.
"""
