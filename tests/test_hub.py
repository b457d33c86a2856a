"""``audit org/name[@revision]``: models on the Hugging Face Hub, read from a cache laid out as
huggingface_hub lays it out, or fetched from a stand-in Hub on 127.0.0.1 that logs every request.
Nothing here reaches the real Hub."""

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
import torch
from safetensors.numpy import save

# Never the real Hub: should this module be the first to import huggingface_hub, its default endpoint is a
# closed local port (the fixtures below point it at the stand-in Hub).
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
pytest.importorskip("huggingface_hub")
import huggingface_hub.constants  # noqa: E402  (after the skip: the package is an optional extra)
from oracles import qhull_argmaxable  # noqa: E402

from auditor.cli.audit import main as audit  # noqa: E402
from auditor.cli.verify import main as audit_verify  # noqa: E402
from auditor.loader.hub_id import is_hub_id, parse_hub_id  # noqa: E402

COMMIT = "3f1c0d9e8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e"
LATER_COMMIT = "9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b"
REPO = "org/name"
HEAD_SHARD = "model-00002-of-00003.safetensors"
NORM_SHARD = "model-00003-of-00003.safetensors"


def head_rows(seed: int) -> np.ndarray:
    """A 50 x 8 head with findings: row 40 copies row 3 (a tie), row 41 is the mean of rows 0-9 (inside the hull)."""
    rows = np.random.default_rng(seed).standard_normal((50, 8)).astype(np.float32)
    rows[40] = rows[3]
    rows[41] = rows[:10].mean(axis=0)
    return rows


def model_files(sharded: bool) -> dict[str, bytes]:
    """A model as a repository holds it: config, vocab.txt and weights, in one file or in three shards
    where only the second holds lm_head.weight and the third the final norm."""
    rng = np.random.default_rng(7)
    embedding = rng.standard_normal((50, 8)).astype(np.float32)  # another matrix: choosing it would show
    tensors = {
        "model.embed_tokens.weight": embedding,
        "model.layers.0.mlp.weight": rng.standard_normal((8, 8)).astype(np.float32),
        "lm_head.weight": head_rows(1),
        "model.layers.1.mlp.weight": rng.standard_normal((8, 8)).astype(np.float32),
        "model.norm.weight": rng.uniform(0.5, 1.5, 8).astype(np.float32),
    }
    files = {
        "config.json": json.dumps({"model_type": "llama", "tie_word_embeddings": False, "rms_norm_eps": 1e-6}).encode(),
        "vocab.txt": "".join(f"tok{k}\n" for k in range(50)).encode(),
    }
    if not sharded:
        files["model.safetensors"] = save(tensors)
        return files
    shards = {"model-00001-of-00003.safetensors": ["model.embed_tokens.weight", "model.layers.0.mlp.weight"],
              HEAD_SHARD: ["lm_head.weight", "model.layers.1.mlp.weight"],
              NORM_SHARD: ["model.norm.weight"]}
    for shard, names in shards.items():
        files[shard] = save({name: tensors[name] for name in names})
    weight_map = {name: shard for shard, names in shards.items() for name in names}
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return files


def as_torch_shards(files: dict[str, bytes]) -> dict[str, bytes]:
    """The sharded model as pytorch_model-*.bin pickles and their pytorch_model.bin.index.json."""
    import io

    import torch
    from safetensors.numpy import load

    index = json.loads(files["model.safetensors.index.json"])
    renamed = {shard: shard.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
               for shard in set(index["weight_map"].values())}
    torch_files = {name: content for name, content in files.items() if not name.startswith("model")}
    for shard, bin_name in renamed.items():
        buffer = io.BytesIO()
        torch.save({name: torch.from_numpy(array) for name, array in load(files[shard]).items()}, buffer)
        torch_files[bin_name] = buffer.getvalue()
    weight_map = {name: renamed[shard] for name, shard in index["weight_map"].items()}
    torch_files["pytorch_model.bin.index.json"] = json.dumps({"weight_map": weight_map}).encode()
    return torch_files


def write_folder(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return folder


def write_cache(cache: Path, repo: str, files: dict[str, bytes], commit: str = COMMIT) -> Path:
    """The huggingface_hub cache layout: blobs by hash, a snapshot folder of relative symlinks, refs/main."""
    repo_folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = repo_folder / "snapshots" / commit
    (repo_folder / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo_folder / "refs").mkdir()
    (repo_folder / "refs" / "main").write_text(commit)
    for name, content in files.items():
        blob = repo_folder / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """huggingface_hub pointed at an empty cache under tmp_path, online, with no login; returns the cache."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    point_at(monkeypatch, "http://127.0.0.1:9")  # the discard port: connections are refused
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return cache


def point_at(monkeypatch, endpoint: str):
    """HF_ENDPOINT for this process: huggingface_hub reads it on import into these two constants."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")


def offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def run_audit(capsys, *args, quiet=True) -> tuple[int, dict | None, str]:
    """``audit ARGS --format json [--quiet]`` in this process: (exit code, the report, stderr)."""
    code = audit([*map(str, args), "--format", "json", *(["--quiet"] if quiet else [])])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out else None), err


def same_audit(report: dict, reference: dict, final_norm: bool = False) -> bool:
    """The same head and the same findings, token for token (where the files lie may differ)."""
    def essence(doc):
        skip = {"path", "token_strings"} | (set() if final_norm else {"final_norm"})
        head = {key: value for key, value in doc["head"].items() if key not in skip}
        return head, doc["domain"], doc["summary"], doc["findings"], doc["summaries"]

    return essence(report) == essence(reference)


def one_error_line(code: int, err: str) -> str:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("audit: error:") and "Traceback" not in err, err
    return lines[0]


# --- ids ---------------------------------------------------------------------------------------------------

def test_ids_and_paths_are_told_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("org/name") and is_hub_id("org/name@main") and is_hub_id("org/Name-2.5_x@refs/pr/1")
    assert parse_hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    assert parse_hub_id("org/name") == ("org/name", None)
    for text in ("name", "./org/name", "/org/name", "org/name/x", "org/name@", "org/-name", "org/na--me",
                 "dir/head.safetensors", "dir/model.gguf", "org/name@a b"):
        assert not is_hub_id(text), text
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # an existing path is a path


def test_a_missing_file_named_like_a_path_is_still_no_such_file(tmp_path, hub_env, capsys):
    code, _, err = run_audit(capsys, tmp_path / "dir" / "head.safetensors")
    assert "no such file or folder" in one_error_line(code, err)


def test_without_huggingface_hub_an_id_says_which_extra_to_install(hub_env, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if not installed
    code, _, err = run_audit(capsys, REPO)
    assert "needs huggingface_hub: pip install 'auditor[hub]'" in one_error_line(code, err)


# --- (a) the local cache -------------------------------------------------------------------------------------

@pytest.fixture
def cached(hub_env, monkeypatch):
    """org/name in the cache at COMMIT, main pointing at it; offline."""
    snapshot = write_cache(hub_env, REPO, model_files(sharded=False))
    offline(monkeypatch)
    return snapshot


def test_cached_id_audits_as_its_snapshot_folder(cached, capsys):
    code, direct, _ = run_audit(capsys, cached)
    assert direct["findings"], "the planted rows are findings"
    for text in (REPO, f"{REPO}@main", f"{REPO}@{COMMIT}"):
        hub_code, report, err = run_audit(capsys, text)
        assert (hub_code, err) == (code, "")
        assert report["head"] == {**direct["head"], "path": f"{REPO}@{COMMIT}"}  # the id, pinned to the commit
        assert report["findings"] == direct["findings"] and report["summary"] == direct["summary"]


def test_offline_and_not_cached_is_one_line(cached, capsys):
    for text in ("other/model", f"{REPO}@v2", f"{REPO}@{'0' * 40}"):
        code, _, err = run_audit(capsys, text)
        line = one_error_line(code, err)
        assert "not in the local cache" in line and "HF_HUB_OFFLINE" in line, line


@pytest.mark.slow
def test_offline_environment_variables_are_honoured_in_a_fresh_process(cached, tmp_path, capsys):
    _, direct, _ = run_audit(capsys, cached)
    env = {**os.environ, "HF_HUB_CACHE": huggingface_hub.constants.HF_HUB_CACHE, "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home"), "HF_ENDPOINT": "http://127.0.0.1:9",
           # the thread count of this process: float sums are grouped by thread, and the certificates' last
           # digits with them
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    env.pop("HF_TOKEN", None)
    done = subprocess.run([sys.executable, "-m", "auditor", REPO, "--format", "json", "--quiet"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 1 and done.stderr == "", done.stderr
    report = json.loads(done.stdout)
    assert report["head"]["path"] == f"{REPO}@{COMMIT}" and report["findings"] == direct["findings"]


def test_offline_a_cached_input_embedding_is_not_taken_for_an_uncached_head(hub_env, monkeypatch, capsys):
    files = model_files(sharded=True)
    del files[HEAD_SHARD]  # only the embedding's shard is cached; config.json says the head is not tied
    write_cache(hub_env, REPO, files)
    offline(monkeypatch)
    code, _, err = run_audit(capsys, REPO)
    assert HEAD_SHARD in one_error_line(code, err)


def partly_cached(cache: Path, tie) -> dict[str, bytes]:
    """The sharded model as an interrupted download leaves it in the cache: config.json (tie_word_embeddings
    as given, None: not said), vocab.txt and the first shard only (the input embedding's), no shard index.
    Returns the repository's files, that config.json included."""
    files = model_files(sharded=True)
    config = {"model_type": "llama", "rms_norm_eps": 1e-6, **({} if tie is None else {"tie_word_embeddings": tie})}
    files["config.json"] = json.dumps(config).encode()
    write_cache(cache, REPO, {name: files[name] for name in ("config.json", "vocab.txt",
                                                             "model-00001-of-00003.safetensors")})
    return files


@pytest.mark.parametrize("tie", [None, False])
def test_offline_a_lone_cached_shard_is_not_taken_for_a_single_file_model(hub_env, monkeypatch, capsys, tie):
    partly_cached(hub_env, tie)
    offline(monkeypatch)
    code, _, err = run_audit(capsys, REPO)  # not the embedding in shard 1, audited as if it were the model
    line = one_error_line(code, err)
    assert "model.safetensors.index.json" in line and "model-00001-of-00003.safetensors" in line, line
    assert "not in the local cache" in line and "HF_HUB_OFFLINE" in line, line


def test_certificates_of_an_id_are_verified_against_the_id(cached, tmp_path, capsys):
    certificates = tmp_path / "certificates.json"
    assert audit([REPO, "--certificates", str(certificates), "--quiet", "--fail-on", "none"]) == 0
    assert json.loads(certificates.read_text())["head"]["path"] == f"{REPO}@{COMMIT}"
    capsys.readouterr()
    assert audit_verify([str(certificates), f"{REPO}@{COMMIT}", "--quiet"]) == 0
    assert "all hold" in capsys.readouterr().out


# --- (c) a local path wins -----------------------------------------------------------------------------------

def test_an_existing_folder_named_like_an_id_is_read_as_a_folder(hub_env, tmp_path, monkeypatch, capsys):
    local = write_folder(tmp_path / "work" / "org" / "name", model_files(sharded=False))
    monkeypatch.chdir(tmp_path / "work")
    offline(monkeypatch)  # and nothing cached: an id could not be resolved
    code, report, err = run_audit(capsys, REPO)
    assert code == 1 and err == ""
    assert report["head"]["path"] == "org/name" and report["head"]["token_strings"] == "org/name/vocab.txt"
    assert same_audit(report, run_audit(capsys, local)[1])


# --- (b) fetching from a stand-in Hub ------------------------------------------------------------------------

class FakeHub:
    """The Hub's endpoints that huggingface_hub calls, for repositories held in memory, on 127.0.0.1:
    GET /api/models/{repo}/revision/{rev} (model_info), HEAD and GET /{repo}/resolve/{rev}/{file} (with Range).
    Answers carry the Hub's headers (X-Repo-Commit, ETag, X-Error-Code); ``requests`` logs each request.
    ``repos`` are those at COMMIT, where main points; ``push_after_model_info`` (commit, repos) moves main to
    a new commit right after the next model_info has answered, as a push in between would."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: tuple[str, ...] = ()):
        self.repos, self.gated, self.requests = repos, gated, []
        self.commits, self.main, self.push_after_model_info = {COMMIT: repos}, COMMIT, None
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        # polled every 10 ms for shutdown (the default 0.5 s was most of each test's time)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def content_fetched(self) -> set[str]:
        """The files whose content was fetched: GETs of /resolve/ without a Range (a range reads a header)."""
        return {path.rsplit("/", 1)[1] for method, path, span in self.requests
                if method == "GET" and "/resolve/" in path and span is None}

    def answer(self, request: BaseHTTPRequestHandler, body: bool):
        path = unquote(request.path.split("?")[0])
        span = request.headers.get("Range")
        self.requests.append((request.command, path, span))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo, revision = "/".join(parts[2:4]), "/".join(parts[5:]) if parts[4:5] == ["revision"] else "main"
            status, headers, content = self.model_info(repo, revision)
        elif len(parts) >= 5 and parts[2] == "resolve":
            status, headers, content = self.resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), span)
        else:
            status, headers, content = 404, {}, b"{}"
        request.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(content))}.items():
            request.send_header(key, value)
        request.end_headers()
        if body:
            request.wfile.write(content)

    def model_info(self, repo: str, revision: str):
        if repo not in self.repos:
            return 404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "Repository not found"}'
        commit = self.main if revision == "main" else revision
        if commit not in self.commits:
            return 404, {"X-Error-Code": "RevisionNotFound"}, b'{"error": "Invalid rev id"}'
        siblings = [{"rfilename": name} for name in sorted(self.commits[commit][repo])]
        info = {"id": repo, "sha": commit, "private": False, "gated": repo in self.gated, "siblings": siblings}
        if self.push_after_model_info is not None:
            pushed, repos = self.push_after_model_info
            self.commits[pushed], self.main, self.push_after_model_info = repos, pushed, None
        return 200, {"Content-Type": "application/json"}, json.dumps(info).encode()

    def resolve(self, repo: str, revision: str, filename: str, span: str | None):
        if repo not in self.repos:
            return 404, {"X-Error-Code": "RepoNotFound"}, b"Repository not found"
        commit = self.main if revision == "main" else revision
        if commit not in self.commits:
            return 404, {"X-Error-Code": "RevisionNotFound"}, b"Invalid rev id"
        if repo in self.gated:
            return 403, {"X-Error-Code": "GatedRepo", "X-Repo-Commit": commit}, b"Access to model is restricted"
        content = self.commits[commit][repo].get(filename)
        if content is None:
            return 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, b"Entry not found"
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(content).hexdigest()}"',
                   "Accept-Ranges": "bytes"}
        if span is None:
            return 200, headers, content
        first, _, last = span.removeprefix("bytes=").partition("-")
        stop = min(int(last) + 1 if last else len(content), len(content))
        headers["Content-Range"] = f"bytes {first}-{stop - 1}/{len(content)}"
        return 206, headers, content[int(first):stop]


@pytest.fixture
def fake_hub(hub_env, monkeypatch):
    hub = FakeHub({REPO: model_files(sharded=True), "org/gated": model_files(sharded=False)}, gated=("org/gated",))
    point_at(monkeypatch, hub.endpoint)
    yield hub
    hub.close()


@pytest.fixture
def local_sharded(tmp_path):
    return write_folder(tmp_path / "local", model_files(sharded=True))


def test_a_sharded_model_fetches_only_the_shard_holding_the_head(fake_hub, local_sharded, capsys):
    code, report, err = run_audit(capsys, REPO, quiet=False)
    assert code == 1 and err == ""  # and no download bars: stderr is not a terminal
    assert fake_hub.content_fetched() == {"config.json", "vocab.txt", "model.safetensors.index.json", HEAD_SHARD}
    assert report["head"]["path"] == f"{REPO}@{COMMIT}" and report["head"]["weight"] == "lm_head.weight"
    assert report["head"]["token_strings"].endswith("vocab.txt")
    assert same_audit(report, run_audit(capsys, local_sharded)[1])


@pytest.mark.slow
def test_hf_endpoint_and_cache_in_the_environment_are_honoured_in_a_fresh_process(fake_hub, local_sharded,
                                                                                   tmp_path, capsys):
    env = {**os.environ, "HF_ENDPOINT": fake_hub.endpoint, "HF_HUB_CACHE": str(tmp_path / "fresh-cache"),
           "HF_HOME": str(tmp_path / "hf-home"), "OMP_NUM_THREADS": str(torch.get_num_threads())}  # as above
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "auditor", REPO, "--format", "json", "--quiet"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 1 and done.stderr == "", done.stderr
    assert fake_hub.content_fetched() == {"config.json", "vocab.txt", "model.safetensors.index.json", HEAD_SHARD}
    assert (tmp_path / "fresh-cache" / "models--org--name" / "snapshots" / COMMIT / HEAD_SHARD).is_file()
    assert same_audit(json.loads(done.stdout), run_audit(capsys, local_sharded)[1])


def test_the_norm_domain_also_fetches_the_shard_holding_the_final_norm(fake_hub, local_sharded, capsys):
    code, report, err = run_audit(capsys, REPO, "--domain", "norm")
    assert code in (0, 1) and err == ""
    assert fake_hub.content_fetched() == {"config.json", "vocab.txt", "model.safetensors.index.json", HEAD_SHARD,
                                          NORM_SHARD}
    assert report["head"]["final_norm"]["tensors"] == ["model.norm.weight"]
    assert same_audit(report, run_audit(capsys, local_sharded, "--domain", "norm")[1], final_norm=True)


def test_what_was_fetched_is_audited_again_offline_without_a_request(fake_hub, monkeypatch, capsys):
    _, online, _ = run_audit(capsys, f"{REPO}@main")
    offline(monkeypatch)
    before = len(fake_hub.requests)
    for text in (REPO, f"{REPO}@{COMMIT}"):
        code, report, err = run_audit(capsys, text)
        assert (code, err) == (1, "") and same_audit(report, online) and report["head"] == online["head"]
    assert len(fake_hub.requests) == before
    # the final norm's shard was never fetched: the norm domain offline says so
    code, _, err = run_audit(capsys, REPO, "--domain", "norm")
    assert NORM_SHARD in one_error_line(code, err)


def test_a_cached_commit_is_audited_without_asking_the_hub(fake_hub, capsys):
    run_audit(capsys, REPO)
    before = len(fake_hub.requests)
    code, _, err = run_audit(capsys, f"{REPO}@{COMMIT}")
    assert (code, err) == (1, "") and len(fake_hub.requests) == before


@pytest.mark.parametrize("tie", [None, False])
def test_a_partly_cached_commit_is_completed_from_the_hub(hub_env, fake_hub, tmp_path, capsys, tie):
    fake_hub.repos[REPO] = partly_cached(hub_env, tie)
    code, report, err = run_audit(capsys, f"{REPO}@{COMMIT}")
    assert (code, err) == (1, "") and report["head"]["weight"] == "lm_head.weight"
    assert fake_hub.content_fetched() == {"model.safetensors.index.json", HEAD_SHARD}  # the rest was cached
    assert same_audit(report, run_audit(capsys, write_folder(tmp_path / "local", fake_hub.repos[REPO]))[1])


def test_any_problem_with_a_cached_commit_falls_back_to_fetching(hub_env, fake_hub, local_sharded, capsys):
    # two stray single files in the cached snapshot (say, fetched by hand), which alone are ambiguous
    stray = {name: save({"x": np.zeros(2, np.float32)}) for name in ("a.safetensors", "b.safetensors")}
    write_cache(hub_env, REPO, stray)
    code, report, err = run_audit(capsys, f"{REPO}@{COMMIT}")
    assert (code, err) == (1, "") and same_audit(report, run_audit(capsys, local_sharded)[1])


def test_a_branch_is_pinned_to_the_commit_whose_files_were_listed(hub_env, fake_hub, local_sharded, monkeypatch,
                                                                   capsys):
    later = model_files(sharded=False)  # main moves on to a single-file model between model_info and the fetches
    fake_hub.push_after_model_info = (LATER_COMMIT, {REPO: later})
    code, report, err = run_audit(capsys, REPO)
    assert (code, err) == (1, "") and report["head"]["path"] == f"{REPO}@{COMMIT}"
    resolved = [path for _, path, _ in fake_hub.requests if "/resolve/" in path]
    assert resolved and all(f"/resolve/{COMMIT}/" in path for path in resolved), resolved  # headers read too
    assert any(span is not None for _, path, span in fake_hub.requests if "/resolve/" in path)
    assert same_audit(report, run_audit(capsys, local_sharded)[1])
    cache = hub_env / "models--org--name"
    assert (cache / "refs" / "main").read_text() == COMMIT and not (cache / "snapshots" / LATER_COMMIT).exists()
    offline(monkeypatch)  # the cache names main's snapshot as it was read
    assert run_audit(capsys, REPO)[2] == ""


def test_list_tensors_reads_headers_and_fetches_no_weights(fake_hub, capsys):
    assert audit([REPO, "--list-tensors"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.weight",
                      "model.layers.1.mlp.weight"]
    assert not any(name.endswith(".safetensors") for name in fake_hub.content_fetched())


def test_bin_shards_are_fetched_when_they_hold_a_tensor_that_could_be_the_head(fake_hub, tmp_path, capsys):
    fake_hub.repos["org/pickled"] = as_torch_shards(model_files(sharded=True))
    code, report, err = run_audit(capsys, "org/pickled")
    assert (code, err) == (1, "")
    # the head's shard and the input embedding's (shapes cannot be read remotely), not the final norm's
    assert fake_hub.content_fetched() == {"config.json", "vocab.txt", "pytorch_model.bin.index.json",
                                          "pytorch_model-00001-of-00003.bin", "pytorch_model-00002-of-00003.bin"}
    local = write_folder(tmp_path / "pickled", fake_hub.repos["org/pickled"])
    assert report["head"]["format"] == "pytorch" and same_audit(report, run_audit(capsys, local)[1])


@pytest.mark.parametrize("text, words", [
    ("nobody/nothing", "nor a model on the Hugging Face Hub"),
    (f"{REPO}@no-such-branch", "no branch, tag or commit 'no-such-branch'"),
    ("org/gated", "gated"),
])
def test_hub_errors_are_one_line_and_exit_two(fake_hub, capsys, text, words):
    code, _, err = run_audit(capsys, text)
    assert words in one_error_line(code, err)


def test_an_unreachable_hub_with_nothing_cached_is_one_line(hub_env, capsys):
    code, _, err = run_audit(capsys, REPO)  # the endpoint is a closed port
    line = one_error_line(code, err)
    assert "cannot be reached" in line and "not in the local cache" in line, line


def test_an_unreachable_hub_falls_back_to_the_cache_and_says_so(fake_hub, monkeypatch, capsys):
    _, online, _ = run_audit(capsys, REPO)
    point_at(monkeypatch, "http://127.0.0.1:9")
    code, report, err = run_audit(capsys, REPO)
    assert (code, err) == (1, "") and same_audit(report, online)
    assert any("cannot be reached" in note and COMMIT in note for note in report["notes"])


def ctranslate2_files() -> tuple[dict[str, bytes], np.ndarray]:
    """A faster-whisper style repository: a CTranslate2 model.bin (an 8 x 3 float32 embedding, the projection an
    alias of it, row 7 the midpoint of rows 1 and 2), config.json, vocabulary.json, and a README the audit has no
    use for; and the rows."""
    rows = np.round(np.random.default_rng(5).standard_normal((7, 3)) * 4) / 4
    rows = np.vstack([rows, (rows[1] + rows[2]) / 2]).astype(np.float32)  # the midpoint, exact

    def string(text: str) -> bytes:  # a uint16 length that counts the trailing NUL
        raw = text.encode()
        return (len(raw) + 1).to_bytes(2, "little") + raw + b"\x00"

    data = rows.tobytes()
    model = (b"\x06\x00\x00\x00" + string("TransformerDecoderSpec") + b"\x01\x00\x00\x00" + b"\x01\x00\x00\x00"
             + string("decoder/embeddings/weight") + b"\x02" + (8).to_bytes(4, "little") + (3).to_bytes(4, "little")
             + b"\x00" + len(data).to_bytes(4, "little") + data
             + b"\x01\x00\x00\x00" + string("decoder/projection/weight") + string("decoder/embeddings/weight"))
    return {"model.bin": model, "config.json": b"{}", "vocabulary.json": json.dumps([f"t{i}" for i in range(8)]).encode(),
            "README.md": b"# a model"}, rows


def test_a_ctranslate2_repository_is_audited_from_its_model_bin(hub_env, monkeypatch, tmp_path, capsys):
    files, rows = ctranslate2_files()
    hub = FakeHub({"org/fw": files})
    point_at(monkeypatch, hub.endpoint)
    try:
        code, report, err = run_audit(capsys, "org/fw")
    finally:
        hub.close()
    assert err == ""
    assert hub.content_fetched() == {"model.bin", "config.json", "vocabulary.json"}
    assert report["head"]["format"] == "ctranslate2" and report["head"]["token_strings"].endswith("vocabulary.json")
    local = run_audit(capsys, write_folder(tmp_path / "fw", files))[1]
    assert same_audit(report, local) and code == 1
    inside = sorted(set(range(8)) - qhull_argmaxable(rows.astype(np.float64)))
    assert 7 in inside
    assert [(f["id"], f["token"]) for f in report["findings"] if f["failing"]] == [(k, f"t{k}") for k in inside]


def test_a_model_bin_without_ctranslate2s_files_is_not_fetched(hub_env, monkeypatch, capsys):
    hub = FakeHub({"org/fasttext": {"model.bin": b"\xba\x16\x4f\x2f" + bytes(64), "README.md": b"# vectors"}})
    point_at(monkeypatch, hub.endpoint)
    try:
        code, _, err = run_audit(capsys, "org/fasttext")
    finally:
        hub.close()
    assert "a CTranslate2 model.bin" in one_error_line(code, err) and hub.content_fetched() == set()
