"""The recorder's worker process: draws the frames it receives and writes one video per key and kind.

A worker is its own interpreter, ``python -m fwdtrace.recorder`` (see :func:`main`), started by
the parent with one end of a socket pair: it never imports the user's main script, so a
training script needs no ``if __name__ == "__main__":`` (multiprocessing's spawn re-imported
it, and a script that made a Recorder at top level failed while bootstrapping). Frames come
in as pickled messages; a credit per frame drawn goes back, and, when it stops, what it did.

A worker never outlives its training process and never leaves a broken file: it ignores
SIGINT (a Ctrl-C reaches the whole process group; the parent's ``stop()`` tells the worker
when to finish), and like DataLoader's workers it watches its parent, so when the parent dies
without warning (kill -9) it closes every file it has written, playable, and exits. A video
is written under a temporary name beside its target and renamed when closed (``_files``), so
a file at the final name is always whole, and a symlink planted there is replaced, not followed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .._files import AtomicFile, write_bytes

__all__ = ["VideoFile", "video_suffix", "run", "main"]

# The message that ends a worker's stream (any other message is a frame).
STOP = None
# What a worker sends back: one CREDIT per frame drawn, then a JSON report of its work when it stops.
CREDIT = b"+"


def video_suffix() -> str:
    """``".mp4"`` when imageio-ffmpeg has an ffmpeg to run (its wheel carries one), else ``".gif"``.

    >>> video_suffix() in (".mp4", ".gif")
    True
    """
    try:
        import imageio_ffmpeg

        exe = imageio_ffmpeg.get_ffmpeg_exe()
    except Exception:  # not installed, or no binary for this platform
        return ".gif"
    return ".mp4" if exe and os.path.exists(exe) else ".gif"


class VideoFile:
    """Frames appended to one video (``.mp4`` through ffmpeg, or ``.gif``), closed into a playable file.

    The frames go to ``{stem}.partial-{random}{suffix}`` beside ``path``; :meth:`close` renames
    it to ``path`` and writes the last frame beside it as a PNG (atomically too).

    >>> import numpy as np, tempfile, imageio.v2 as imageio
    >>> path = Path(tempfile.mkdtemp()) / "demo.gif"
    >>> video = VideoFile(path, fps=10)
    >>> for v in (0, 255):
    ...     video.append(np.full((32, 32, 3), v, dtype=np.uint8))
    >>> path.exists(), video.close(), len(imageio.mimread(path))
    (False, None, 2)
    """

    def __init__(self, path: Path, fps: float) -> None:
        import imageio.v2 as imageio

        self.path = path
        self.frames = 0
        self.last: Any = None
        self._file = AtomicFile(path, caller="Recorder", partial_name=True, keep_suffix=True)
        try:
            if path.suffix == ".mp4":
                # yuv420p plays everywhere; frames are already a multiple of 16 pixels, so no resizing.
                self._writer = imageio.get_writer(
                    self._file.tmp, format="FFMPEG", fps=fps, codec="libx264", pixelformat="yuv420p", macro_block_size=16
                )
            else:
                self._writer = imageio.get_writer(self._file.tmp, format="GIF", mode="I", duration=1000 / fps, loop=0)
        except BaseException:
            self._file.discard()
            raise

    def append(self, frame: Any) -> None:
        self._writer.append_data(frame)
        self.last = frame
        self.frames += 1

    def close(self) -> None:
        import imageio.v2 as imageio

        try:
            self._writer.close()
        except BaseException:
            self._file.discard()
            raise
        self._file.commit()
        if self.last is not None:
            png = imageio.imwrite("<bytes>", self.last, format="PNG")
            write_bytes(self.path.with_suffix(".png"), png, caller="Recorder")


def _parent_alive(parent_pid: int) -> bool:
    # Reparenting is what a dead parent leaves behind (os.getppid() changes), as DataLoader's
    # ManagerWatchdog checks; a pid test covers parents that are not our direct parent.
    if os.getppid() != parent_pid:
        return False
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def run(conn: Any, parent_pid: int, out_dir: str, suffix: str, fps: float, timeout: float,
        bins: int | tuple[float, ...] = 60) -> None:
    """The worker's main loop: frames in from ``conn``, videos out to ``out_dir``, until told to stop.

    Each message is ``(stem, title, payload, views)``; ``None`` means stop. A frame drawn
    sends a :data:`CREDIT` back, so the sender keeps only a few items in the pipe; the last
    message back is ``{"frames": n, "draw_s": s, "not_drawn": {stem: n}, "errors": {stem: why}}``
    (JSON): the frames drawn, the seconds spent drawing and encoding them, and per file the frames
    that could not be drawn and the first reason (nothing is printed: the worker shares the
    training process's terminal; the parent counts and reports them). Stops, closing every file, also when the parent is gone (checked
    at least every ``timeout / 4`` seconds, so the worker exits within ``timeout``) or the
    connection breaks. ``bins``: the histograms' bins (:class:`~fwdtrace.instrument.bins.SteadyBins`).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(10)  # drawing yields the cores to training; frames are dropped instead
    except OSError:
        pass
    from .views import FrameCanvas

    videos: dict[str, VideoFile] = {}
    canvases: dict[str, FrameCanvas] = {}
    poll = max(0.01, min(1.0, timeout / 4))
    frames, busy = 0, 0.0
    not_drawn: dict[str, int] = {}
    errors: dict[str, str] = {}
    try:
        while _parent_alive(parent_pid):
            if not conn.poll(poll):
                continue
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the parent closed its end or died
                break
            if message is STOP:
                break
            stem, title, payload, views = message
            start = time.perf_counter()
            try:
                canvas = canvases.get(stem) or canvases.setdefault(stem, FrameCanvas(bins))
                frame = canvas.draw(title, payload, views)
                if stem not in videos:
                    videos[stem] = VideoFile(Path(out_dir) / f"{stem}{suffix}", fps)
                videos[stem].append(frame)
                frames += 1
            except Exception as e:  # one frame that cannot be drawn must not end the other videos
                not_drawn[stem] = not_drawn.get(stem, 0) + 1
                errors.setdefault(stem, _why(e))
            finally:
                busy += time.perf_counter() - start
                _send(conn, CREDIT)
    finally:
        start = time.perf_counter()
        for stem, video in videos.items():
            try:
                video.close()
            except Exception as e:  # one file that cannot be finished must not leave the others unfinished
                errors[stem] = f"closing the video: {_why(e)}"
        busy += time.perf_counter() - start
        report = {"frames": frames, "draw_s": busy, "not_drawn": not_drawn, "errors": errors}
        _send(conn, json.dumps(report).encode())
        conn.close()


def _why(e: BaseException) -> str:
    """One line: the exception and where in fwdtrace's code it was raised."""
    where = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ is not None else []
    at = f" (at {Path(where[0].filename).name}:{where[0].lineno})" if where else ""
    return f"{type(e).__name__}: {str(e)[:300]}{at}"


def _send(conn: Any, data: bytes) -> None:
    try:
        conn.send_bytes(data)
    except OSError:  # the parent is gone: the watchdog ends the loop
        pass


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m fwdtrace.recorder FD CONFIG``: run on the inherited socket ``FD``.

    ``CONFIG`` is JSON with ``parent_pid``, ``out_dir``, ``suffix``, ``fps``, ``timeout`` and
    ``bins``, the arguments of :func:`run`. (POSIX only: the socket is passed as a file descriptor.)
    """
    from multiprocessing.connection import Connection

    fd, config = (sys.argv[1:] if argv is None else argv)
    settings = json.loads(config)
    if isinstance(settings.get("bins"), list):
        settings["bins"] = tuple(settings["bins"])
    run(Connection(int(fd)), **settings)
