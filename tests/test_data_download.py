"""The downloader against a local HTTP server (127.0.0.1, port 0): never the real network."""

from __future__ import annotations

import hashlib
import http.server
import io
import tarfile
import threading
import urllib.request
import zipfile

import pytest

from txl.data.download import download, extract


class _Server:
    """Serves ``files``; can ignore Range and cut the next response after ``cut_after`` bytes."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.range_support = True
        self.cut_after: int | None = None
        self.log: list[dict] = []  # one entry per request: path, range header, first byte, bytes sent
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):  # noqa: N802 (http.server's naming)
                data = server.files.get(self.path)
                if data is None:
                    self.send_error(404)
                    return
                header = self.headers.get("Range")
                start = 0
                if header and server.range_support:
                    start = int(header.removeprefix("bytes=").split("-")[0])
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.end_headers()
                        server.log.append({"path": self.path, "range": header, "start": start, "sent": 0})
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if server.cut_after is not None:  # send part of the body, then drop the connection
                    body, server.cut_after = body[:server.cut_after], None
                # Log before sending: once the client has the bytes it may retry at once, and the
                # retry's handler thread must not be able to log first.
                server.log.append({"path": self.path, "range": header, "start": start, "sent": len(body)})
                self.wfile.write(body)
                self.wfile.flush()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def _zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


PAYLOAD = bytes(range(256)) * 40  # 10,240 bytes


def test_happy_path_verifies_and_extracts_zip(server, tmp_path):
    archive = _zip_bytes({"corpus/train.txt": b"hello\n", "corpus/valid.txt": b"world\n"})
    server.files["/c.zip"] = archive
    dest = download(f"{server.url}/c.zip", tmp_path / "c.zip", sha256=_sha(archive))
    assert dest.read_bytes() == archive and not (tmp_path / "c.zip.part").exists()
    names = extract(dest, tmp_path / "out")
    assert sorted(names) == ["corpus/train.txt", "corpus/valid.txt"]
    assert (tmp_path / "out" / "corpus" / "train.txt").read_bytes() == b"hello\n"
    # A second call finds the verified file and makes no request.
    n = len(server.log)
    download(f"{server.url}/c.zip", tmp_path / "c.zip", sha256=_sha(archive))
    assert len(server.log) == n


def test_extracts_tar_gz(server, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        info = tarfile.TarInfo("d/ptb.train.txt")
        info.size = 4
        t.addfile(info, io.BytesIO(b"a b\n"))
    server.files["/c.tgz"] = buf.getvalue()
    dest = download(f"{server.url}/c.tgz", tmp_path / "c.tgz", sha256=_sha(buf.getvalue()))
    extract(dest, tmp_path)
    assert (tmp_path / "d" / "ptb.train.txt").read_text() == "a b\n"


def test_checksum_mismatch_names_both_hashes_and_keeps_dest_clean(server, tmp_path):
    server.files["/f.bin"] = PAYLOAD
    wrong = "0" * 64
    with pytest.raises(ValueError) as err:
        download(f"{server.url}/f.bin", tmp_path / "f.bin", sha256=wrong)
    msg = str(err.value)
    assert wrong in msg and _sha(PAYLOAD) in msg and "delete" in msg
    assert not (tmp_path / "f.bin").exists()


def test_resume_after_cut_connection_requests_the_rest(server, tmp_path):
    server.files["/f.bin"] = PAYLOAD
    server.cut_after = 3000
    with pytest.raises(ConnectionError, match="run the same command again to resume"):
        download(f"{server.url}/f.bin", tmp_path / "f.bin", sha256=_sha(PAYLOAD), retries=0)
    assert (tmp_path / "f.bin.part").stat().st_size == 3000 and not (tmp_path / "f.bin").exists()
    download(f"{server.url}/f.bin", tmp_path / "f.bin", sha256=_sha(PAYLOAD), retries=0)
    second = server.log[-1]
    assert second["range"] == "bytes=3000-" and second["start"] == 3000
    assert second["sent"] == len(PAYLOAD) - 3000  # only the missing bytes travelled
    assert (tmp_path / "f.bin").read_bytes() == PAYLOAD and not (tmp_path / "f.bin.part").exists()


def test_automatic_retry_resumes_within_one_call(server, tmp_path):
    server.files["/f.bin"] = PAYLOAD
    server.cut_after = 1234
    download(f"{server.url}/f.bin", tmp_path / "f.bin", sha256=_sha(PAYLOAD), retries=2)
    assert [e["start"] for e in server.log] == [0, 1234]
    assert (tmp_path / "f.bin").read_bytes() == PAYLOAD


def test_server_without_range_support_restarts_cleanly(server, tmp_path):
    server.files["/f.bin"] = PAYLOAD
    server.range_support = False
    server.cut_after = 5000
    with pytest.raises(ConnectionError):
        download(f"{server.url}/f.bin", tmp_path / "f.bin", sha256=_sha(PAYLOAD), retries=0)
    download(f"{server.url}/f.bin", tmp_path / "f.bin", sha256=_sha(PAYLOAD), retries=0)
    assert server.log[-1]["range"] == "bytes=5000-" and server.log[-1]["start"] == 0  # Range ignored
    assert (tmp_path / "f.bin").read_bytes() == PAYLOAD  # not 5000 stale bytes + the whole file


def test_missing_checksum_warns_but_keeps_file(server, tmp_path, caplog):
    server.files["/v.txt"] = b"</S>\n<S>\n"
    with caplog.at_level("WARNING"):
        download(f"{server.url}/v.txt", tmp_path / "v.txt", sha256=None)
    assert "no published sha256" in caplog.text and _sha(b"</S>\n<S>\n") in caplog.text
    assert (tmp_path / "v.txt").read_bytes() == b"</S>\n<S>\n"


def test_extract_refuses_members_outside_target(tmp_path):
    bad = tmp_path / "bad.zip"
    bad.write_bytes(_zip_bytes({"../escape.txt": b"x"}))
    with pytest.raises(ValueError, match="outside"):
        extract(bad, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists()


def test_download_corpus_end_to_end_from_local_archive(server, tmp_path):
    from txl.data.corpora import REGISTRY, Download, download_corpus, load_corpus

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for split, text in (("train", b"a b c\nb c\n"), ("valid", b"a b\n"), ("test", b"c\n")):
            info = tarfile.TarInfo(f"simple-examples/data/ptb.{split}.txt")
            info.size = len(text)
            t.addfile(info, io.BytesIO(text))
    server.files["/simple-examples.tgz"] = buf.getvalue()
    archive = Download(url=f"{server.url}/simple-examples.tgz", sha256=_sha(buf.getvalue()),
                       filename="simple-examples.tgz")
    spec = REGISTRY["ptb"].replace(downloads=(archive,))
    data_dir = download_corpus(spec, tmp_path / "ptb")
    corpus = load_corpus(spec, data_dir, cache_dir=tmp_path / "cache")
    assert len(corpus.train) == 7 and corpus.vocab_size == 4  # <eos> b c a
    with pytest.raises(ValueError, match="known|downloaded"):
        download_corpus("ptb-xl", tmp_path)


def test_mirrors_are_tried_in_order_until_one_serves_the_right_bytes(server, tmp_path, caplog):
    server.files["/wrong.zip"] = PAYLOAD[::-1]  # a mirror serving other bytes
    server.files["/good.zip"] = PAYLOAD
    urls = [f"{server.url}/gone.zip", f"{server.url}/wrong.zip", f"{server.url}/good.zip"]
    md5 = hashlib.md5(PAYLOAD).hexdigest()
    with caplog.at_level("WARNING"):
        dest = download(urls, tmp_path / "f.zip", sha256=_sha(PAYLOAD), md5=md5, retries=0)
    assert dest.read_bytes() == PAYLOAD and not (tmp_path / "f.zip.part").exists()
    assert [e["path"] for e in server.log] == ["/wrong.zip", "/good.zip"]  # /gone.zip: a 404, not logged
    assert "HTTP Error 404" in caplog.text and "checksum mismatch" in caplog.text
    assert "trying the next mirror" in caplog.text


def test_an_unresolvable_host_moves_to_the_next_mirror_at_once(server, tmp_path, caplog, monkeypatch):
    """A host name that does not resolve (RFC 6761: .invalid never does) is asked once, not retries + 1 times:
    offline, every mirror is one line and the error comes at once."""
    server.files["/good.zip"] = PAYLOAD
    asked = []
    real = urllib.request.urlopen
    monkeypatch.setattr(urllib.request, "urlopen", lambda req, **kw: asked.append(req.full_url) or real(req, **kw))
    urls = ["http://txl-mirror-a.invalid/f.zip", "http://txl-mirror-b.invalid/f.zip", f"{server.url}/good.zip"]
    with caplog.at_level("WARNING"):
        dest = download(urls, tmp_path / "f.zip", sha256=_sha(PAYLOAD), retries=3)
    assert dest.read_bytes() == PAYLOAD
    assert asked == urls  # each mirror once: no retry of a name that does not resolve
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("trying the next mirror" in line for line in lines)
    assert "cannot resolve the host name txl-mirror-a.invalid" in lines[0]
    assert "cannot resolve the host name txl-mirror-b.invalid" in lines[1]


def test_offline_every_mirror_fails_at_once_with_one_line_each(tmp_path, caplog, monkeypatch):
    asked = []
    real = urllib.request.urlopen
    monkeypatch.setattr(urllib.request, "urlopen", lambda req, **kw: asked.append(req.full_url) or real(req, **kw))
    urls = ["http://txl-mirror-a.invalid/f.zip", "http://txl-mirror-b.invalid/f.zip"]
    with caplog.at_level("WARNING"), pytest.raises(ConnectionError, match=r"every mirror of f.zip failed .*"
                                                   r"cannot resolve the host name txl-mirror-a.invalid.*"
                                                   r"cannot resolve the host name txl-mirror-b.invalid"):
        download(urls, tmp_path / "f.zip", sha256=None, retries=3)
    assert asked == urls and len(caplog.records) == 1  # the second mirror's line is the error itself


def test_md5_pin_alone_is_checked(server, tmp_path):
    server.files["/f.bin"] = PAYLOAD
    with pytest.raises(ValueError, match="expected md5 0{32}, got " + hashlib.md5(PAYLOAD).hexdigest()):
        download(f"{server.url}/f.bin", tmp_path / "f.bin", sha256=None, md5="0" * 32, retries=0)


def test_every_mirror_failing_names_each_failure(server, tmp_path):
    urls = [f"{server.url}/a.zip", f"{server.url}/b.zip"]
    with pytest.raises(ConnectionError, match=r"every mirror of f.zip failed \(.*/a.zip: HTTP Error 404.*"
                       r"/b.zip: HTTP Error 404"):
        download(urls, tmp_path / "f.zip", sha256=None, retries=0)


def test_progress_bar_counts_every_byte(server, tmp_path, monkeypatch):
    tqdm = pytest.importorskip("tqdm")
    bars = []

    class Bar(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": False, "file": io.StringIO()})
            bars.append(self)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    server.files["/f.bin"] = PAYLOAD
    download(f"{server.url}/f.bin", tmp_path / "f.bin", sha256=_sha(PAYLOAD))
    assert len(bars) == 1 and bars[0].n == bars[0].total == len(PAYLOAD)


def test_wikitext_downloads_try_a_live_mirror_first_and_pin_torchtexts_md5():
    from txl.data.corpora import REGISTRY

    for name, md5 in (("wt103", "9ddaacaf6af0710eda8c456decff7832"), ("wt2", "542ccefacc6c27f945fb54453812b3cd")):
        (item,) = REGISTRY[name].downloads
        assert item.url.startswith("https://wikitext.smerity.com/") and item.md5 == md5
        assert item.mirrors[0].startswith("https://s3.amazonaws.com/research.metamind.io/wikitext/")
        assert item.sha256 is not None
