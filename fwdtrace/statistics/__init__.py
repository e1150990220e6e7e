"""One engine for every statistic fwdtrace stores: a tensor's summary as one small vector.

>>> import torch
>>> from fwdtrace.statistics import as_dict, summarize
>>> d = as_dict(summarize(torch.tensor([1.0, 2.0, float("nan"), 0.0])))
>>> d["count"], d["nans"], d["zeros"], d["mean"], d["histogram"][d["histogram"].index(1.0)]
(4.0, 1.0, 1.0, 1.0, 1.0)

Probe statistics (:class:`~fwdtrace.instrument.stats.RunningStats`), statistics dumps, the live
page's and the recorder's histograms (:class:`~fwdtrace.instrument.bins.SteadyBins`) and the
hooks inside compiled graphs all summarise a tensor here, so the same tensor gives the same
numbers in every tool. Running statistics are merges of these summaries (see
:class:`~fwdtrace.instrument.stats.RunningStats`).

**The vector.** The :data:`FIELDS`: count, finite, NaN, Inf and zero counts, then mean, std
(population, ``correction=0``), min, max and L2 norm of the finite values (NaN with none), then
the histogram's placement (``bin_exponent``, ``bin_start``: bin ``i`` is
``[(start + i) * 2**exponent, (start + i + 1) * 2**exponent)``) and the sampled values it left
outside (``underflow``, ``overflow``: on given edges, or one bin across zero); then ``bins`` histogram counts; then up to :data:`SAMPLES`
values at evenly spaced flat positions (:func:`sample_positions`).

**Exactness.** Counts are exact, and so are min and max as float64 holds them (an integer past
2**53 is rounded to float64). Sums run in float32 for float32, float16 and bfloat16 tensors
(torch's cascaded sum; the squares as the norms of rows of 1,024 values) and in float64
otherwise (and for float32 tensors of up to 8,192 values), and add up in float64: mean, std
and norm are exact to about the tensor's own rounding. Squares past float32's range (values above about 1.8e19) and sums that overflow are
taken again in float64; NaN and Inf are counted and left out of every moment.

**The histogram rule: power-of-two bins.** A histogram's bins have a width that is a power of
two and edges that are multiples of it: the narrowest such width whose ``bins`` bins hold every
finite value, the occupied bins centred (:func:`place`; a single bin cannot hold both signs:
it holds the negative end). Two histograms on this rule merge
exactly: a wider bin is a whole number of narrower ones, so counts are moved, never split
(:func:`rebin`). Edges given by a user (``edges=``) are kept as given, with what falls outside
counted as underflow and overflow.

**Sampled bins.** A tensor of more than :data:`HISTOGRAM_SAMPLE` values is binned from that
many values at fixed positions spread over it (a Weyl sequence: the same positions for the same
size, so two runs' histograms count the same elements, and no stride that follows a channel
layout): binning every value would cost a second full pass, several times the moments' cost.
Each bin's share of the values is then an estimate with a standard error of at most
``0.5 / sqrt(HISTOGRAM_SAMPLE)`` (0.8 %); smaller tensors are binned whole. The counts are
those of the sampled values: compare shapes, not totals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .rule import (
    BINS,
    BLOCK,
    COMPARED,
    FIELDS,
    HISTOGRAM_SAMPLE,
    SAMPLES,
    as_dict,
    compared,
    histogram_positions,
    place_float,
    rebin,
    sample_positions,
    width,
)

if TYPE_CHECKING:
    from .engine import place, summarize, summarize_all, summarize_blocks, summarize_in_graph

__all__ = ["FIELDS", "BINS", "SAMPLES", "HISTOGRAM_SAMPLE", "BLOCK", "COMPARED", "summarize", "summarize_all",
           "summarize_blocks", "summarize_in_graph", "sample_positions", "histogram_positions", "place", "place_float",
           "rebin", "as_dict", "compared", "width"]

_ENGINE = ("summarize", "summarize_all", "summarize_blocks", "summarize_in_graph", "place")


def __getattr__(name: str) -> Any:
    """The computing half (:mod:`fwdtrace.statistics.engine`, which needs torch) on first use."""
    if name in _ENGINE:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
