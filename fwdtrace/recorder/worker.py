"""The recorder's worker process: draws the frames it receives and writes one video per key and kind.

A worker never outlives its training process and never leaves a broken file: it ignores
SIGINT (a Ctrl-C reaches the whole process group; the parent's ``stop()`` tells the worker
when to finish), and like DataLoader's workers it watches its parent, so when the parent dies
without warning (kill -9) it closes every file it has written, playable, and exits. A video
is written under a temporary name beside its target and renamed when closed (``_files``), so
a file at the final name is always whole, and a symlink planted there is replaced, not followed.
"""

from __future__ import annotations

import os
import signal
import traceback
from pathlib import Path
from typing import Any

from .._files import AtomicFile, write_bytes

__all__ = ["VideoFile", "video_suffix", "run"]

# The message that ends a worker's stream (any other message is a frame).
STOP = None


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


def run(conn: Any, credits: Any, parent_pid: int, out_dir: str, suffix: str, fps: float, timeout: float) -> None:
    """The worker's main loop: frames in from ``conn``, videos out to ``out_dir``, until told to stop.

    Each message is ``(stem, title, payload, views)``; ``None`` means stop. A frame drawn
    releases ``credits`` once, so the sender keeps only a few items in the pipe. Stops, closing every
    file, also when the parent is gone (checked at least every ``timeout / 4`` seconds, so the
    worker exits within ``timeout``) or the connection breaks.
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
            try:
                canvas = canvases.get(stem) or canvases.setdefault(stem, FrameCanvas())
                frame = canvas.draw(title, payload, views)
                if stem not in videos:
                    videos[stem] = VideoFile(Path(out_dir) / f"{stem}{suffix}", fps)
                videos[stem].append(frame)
            except Exception:  # one frame that cannot be drawn must not end the other videos
                traceback.print_exc()
            finally:
                credits.release()
    finally:
        for video in videos.values():
            try:
                video.close()
            except Exception:  # one file that cannot be finished must not leave the others unfinished
                traceback.print_exc()
        conn.close()
