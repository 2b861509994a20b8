"""``trustbatch train`` on a Parquet file and on a saved datasets directory, then ``trustbatch export`` round-trips:
the directory loads with ``AutoModelForCausalLM.from_pretrained``, ``trustbatch eval`` on it gives the run's last
held-out numbers, and a LoRA run's export holds ``W + (alpha/r)·B·A`` computed here from the checkpoint's adapter and
the base's tensors.

Runs on the real stories260K model (it has spread under ``scorers_for_tests:even_length``, a 0/1 reward, so that
pass@1 equals the held-out mean reward and both are away from 0 and 1)."""

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

import datasets  # noqa: E402 - a core dependency: a datasets that fails to import fails here, not skips
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from trustbatch.config import load_config  # noqa: E402
from trustbatch.errors import UserError  # noqa: E402
from trustbatch.recipes import train  # noqa: E402
from trustbatch.recipes.export import export_run  # noqa: E402

from lora_merge import merged_by_hand  # noqa: E402

ROWS = [{"problem": f"Lily has {i} apples and finds {i % 7 + 1} more. How many apples does she have?",
         "answer": i + i % 7 + 1} for i in range(40)]
RUN = ["reward.name=scorers_for_tests:even_length", "reward.workers=0", "rollout.prompts_per_step=4",
       "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=2", "train.lr=1e-2", "eval.every=2",
       "eval.samples_per_prompt=4", "checkpoint_every=2", "data.heldout_size=8"]
QUIET = Console(file=io.StringIO())


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    """load_dataset's Arrow copies of the files go to the test's folder (this process's and the eval process's)."""
    cache = str(tmp_path_factory.mktemp("hf-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        mp.setenv("HF_DATASETS_CACHE", cache)
        yield


@pytest.fixture(scope="module")
def parquet_run(tmp_path_factory, shared_dir, hf_cache):
    """A full fine-tuning run trained on a Parquet file, held out on a JSON file; its export (shared by the tests
    below, which only read it). Both are written under umask 027 (UMASK), so that a mode the umask gives (0640,
    0750) differs from mkstemp's and mkdtemp's (0600, 0700) and from one set without the umask (0644, 0755)."""
    tmp_path = tmp_path_factory.mktemp("parquet_run")
    pq.write_table(pa.Table.from_pylist(ROWS[8:]), tmp_path / "train.parquet")
    (tmp_path / "held.json").write_text(json.dumps(ROWS[:8]))
    run, out = tmp_path / "run", tmp_path / "export"
    model = shared_dir / "models" / "stories260K-hf"
    cfg = load_config(None, RUN + [f"data={tmp_path / 'train.parquet'}", f"data.heldout={tmp_path / 'held.json'}",
                                   f"model.path={model}", f"run_dir={run}"])
    old = os.umask(UMASK)
    try:
        summary = train(cfg, console=QUIET)
        return run, out, summary, export_run(run, out)
    finally:
        os.umask(old)


UMASK = 0o027


def test_run_files_and_the_export_honour_the_umask(parquet_run):
    """Every file and folder of the run and of its export has the mode open() and mkdir() give under the umask."""
    run, out, _, _ = parquet_run
    paths = [p for root in (run, out) for p in root.rglob("*")] + [out]
    assert len(paths) > 15 and any(p.parent.name.startswith("step_") for p in paths)  # checkpoints and their files
    modes = {str(p): oct(p.stat().st_mode & 0o777) for p in paths}
    want = {str(p): oct((0o777 if p.is_dir() else 0o666) & ~UMASK) for p in paths}
    assert modes == want


def test_the_model_card_holds_no_local_path_and_names_the_version_without_git(parquet_run, shared_dir, monkeypatch):
    import tomllib

    from trustbatch.recipes import export

    run, out, _, res = parquet_run
    card = (out / "README.md").read_text()
    local = [str(run.parent), str(shared_dir.resolve()), str(shared_dir), os.path.expanduser("~")]
    assert "held.json" in card and "stories260K-hf" in card  # named, without their folders
    assert [p for p in local if p in card] == []
    assert str(run.parent) in " ".join(res["eval_command"])  # the command printed here keeps them: it runs here
    assert "Exported from `run/checkpoints/step_000002`" in card

    # an installed copy (no git): the card names the package version, read here from pyproject.toml
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    version = tomllib.loads(pyproject.read_text())["project"]["version"]
    assert json.loads((run / "segments.jsonl").read_text().splitlines()[0])["version"] == version
    monkeypatch.setattr(export, "git_commit", lambda: "unknown")
    seg = run.parent / "installed-run"
    seg.mkdir()
    (seg / "segments.jsonl").write_text(json.dumps({"commit": "unknown", "version": version}) + "\n")
    cfg = load_config(None, [a for a in RUN if not a.startswith("data.")])  # no data.train here: no data keys
    card = export.model_card(cfg, seg, seg / "checkpoints" / "step_000002", 2, {}, None)
    assert f"with trustbatch version `{version}`; trained with trustbatch version `{version}`." in card
    assert "unknown" not in card


def test_the_printed_check_runs_from_anywhere_and_the_card_keeps_relative_paths(tmp_path, shared_dir, hf_cache,
                                                                                 monkeypatch):
    """A run given its data relative to the directory it started in, exported from another directory: the printed
    check command names the data absolute (they exist, from anywhere) and the export by its absolute path; the card's
    command keeps the relative paths and holds no absolute local path."""
    import shlex

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    (start / "data").mkdir(parents=True)
    elsewhere.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[8:]), start / "data" / "train.parquet")
    (start / "data" / "held.json").write_text(json.dumps(ROWS[:8]))
    model = shared_dir / "models" / "stories260K-hf"
    monkeypatch.chdir(start)
    train(load_config(None, RUN + ["data=data/train.parquet", "data.heldout=data/held.json", "data.dir=data",
                                   f"model.path={model}", "run_dir=run"]), console=QUIET)
    p = subprocess.run([sys.executable, "-m", "trustbatch", "export", str(start / "run"), "--out", "export"],
                       cwd=elsewhere, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    [line] = [x for x in p.stdout.splitlines() if x.startswith("check: ")]
    cmd = shlex.split(line.removeprefix("check: "))
    arg = {flag: cmd[cmd.index(flag) + 1] for flag in ("--model", "-b", "--data-dir")}
    assert arg == {"--model": str(elsewhere / "export"), "-b": str(start / "data" / "held.json"),
                   "--data-dir": str(start / "data")}
    assert Path(arg["-b"]).is_file() and Path(arg["--data-dir"]).is_dir()
    card = (elsewhere / "export" / "README.md").read_text()
    assert str(tmp_path) not in card and str(shared_dir.resolve()) not in card
    assert "-b data/held.json" in card and "--data-dir data " in card and "--model export " in card


def test_export_loads_with_from_pretrained_and_scores_as_the_last_evaluation(parquet_run, support_on_pythonpath):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, out, summary, res = parquet_run
    assert summary["heldout_prompts"] == 8 and res["step"] == 2 and not res["lora"]
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"} <= {
        p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).eos_token_id == model.generation_config.eos_token_id == 2
    saved = load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors"))
    state = model.state_dict()
    assert saved and all(torch.equal(state[k], v) for k, v in saved.items())  # the trained weights, not the base's
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["do_sample"], gen["temperature"], gen["max_new_tokens"]) == (True, 1.0, 6)
    # generate() with the export's own config samples what training sampled, softmax(logits / T) over all 512 tokens:
    # without top_k in the file it applied its default top-k 50
    ids = torch.tensor([[1, 5, 6, 7]])
    g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, output_scores=True,
                       output_logits=True, return_dict_in_generate=True)
    assert torch.isfinite(g.scores[0]).all() and torch.equal(g.scores[0], g.logits[0] / gen["temperature"])
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2 and 0.1 < last["heldout_accuracy"] < 0.9
    card = (out / "README.md").read_text()
    commit = json.loads((run / "segments.jsonl").read_text().splitlines()[0])["commit"]
    assert f"trained with trustbatch commit `{commit}`" in card
    assert f"| heldout_accuracy | {last['heldout_accuracy']:.4f} |" in card
    assert "objective:\n  name: p3o" in card and "held.json" in card  # the resolved config, as YAML

    cmd = res["eval_command"]
    assert cmd[:2] == ["trustbatch", "eval"] and "held.json" in cmd[cmd.index("-b") + 1]
    dest = out.parent / "eval.json"
    p = subprocess.run([sys.executable, "-m", "trustbatch", *cmd[1:], "--workers", "0", "--out", str(dest)],
                       capture_output=True, text=True, timeout=600, env=os.environ)
    assert p.returncode == 0, p.stderr[-2000:]
    held = json.loads(dest.read_text())["benchmarks"]["held"]
    assert held["prompts"] == 8
    assert held["pass@1"] == pytest.approx(last["heldout_accuracy"], abs=1e-12)
    assert held["pass@4"] == pytest.approx(last["heldout_pass@4"], abs=1e-12)
    assert held["pass@1_se"] == pytest.approx(last["heldout_accuracy_se"], abs=1e-12)  # the per-prompt spread too


def test_the_cards_command_samples_with_the_runs_random_streams(tmp_path, shared_dir, hf_cache,
                                                               support_on_pythonpath):
    """Held-out evaluation samples with rollout.noise (and rollout.decode); the card's command left them out, so a
    philox run's check sampled other tokens (the reviewer's: 0.688 where the run logged 0.469)."""
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    run, out = tmp_path / "run", tmp_path / "export"
    train(load_config(None, RUN + [f"data={tmp_path / 'rows.jsonl'}", f"model.path={shared_dir / 'models' / 'stories260K-hf'}",
                                   f"run_dir={run}", "rollout.noise=philox"]), console=QUIET)
    cmd = export_run(run, out)["eval_command"]
    assert cmd[cmd.index("--noise") + 1] == "philox" and "--decode" not in cmd  # the default loop is not named
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    dest = tmp_path / "eval.json"
    p = subprocess.run([sys.executable, "-m", "trustbatch", *cmd[1:], "--workers", "0", "--out", str(dest)],
                       capture_output=True, text=True, timeout=600, env=os.environ)
    assert p.returncode == 0, p.stderr[-2000:]
    again = json.loads(dest.read_text())["benchmarks"]["rows"]
    assert again["pass@1"] == pytest.approx(last["heldout_accuracy"], abs=1e-12)
    assert again["pass@4"] == pytest.approx(last["heldout_pass@4"], abs=1e-12)


@pytest.mark.slow  # a bf16-mixed run and two evaluations in their own processes (~30 s): make test under 10 minutes
def test_the_cards_command_samples_and_scores_as_a_bf16_mixed_run(tmp_path, shared_dir, hf_cache,
                                                                  support_on_pythonpath):
    """A bf16-mixed run's held-out evaluation samples under the learner's bf16 autocast, and scores within its
    reward.timeout_s: the card's command sampled in float32 (a reviewer's run: pass@1 0.275 where the run logged
    0.294) and scored within eval's default 10 s. Reference: the run's own metrics line, from the command as the card
    prints it (nothing appended)."""
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    run, out = tmp_path / "run", tmp_path / "export"
    train(load_config(None, RUN + [f"data={tmp_path / 'rows.jsonl'}", f"model.path={shared_dir / 'models' / 'stories260K-hf'}",
                                   f"run_dir={run}", "train.precision=bf16-mixed", "reward.timeout_s=7",
                                   "rollout.max_new_tokens=24", "eval.samples_per_prompt=8", "data.heldout_size=16",
                                   "train.steps=1", "eval.every=1", "checkpoint_every=1"]), console=QUIET)
    cmd = export_run(run, out)["eval_command"]
    assert cmd[cmd.index("--precision") + 1] == "bf16-mixed" and cmd[cmd.index("--timeout") + 1] == "7"
    assert cmd[cmd.index("--workers") + 1] == "0"  # the run scored in its own process, with no time limit
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    runs = {}
    for name, args in (("card", cmd[1:]), ("float32", [a for a in cmd[1:] if a not in ("--precision", "bf16-mixed")])):
        dest = tmp_path / f"{name}.json"
        p = subprocess.run([sys.executable, "-m", "trustbatch", *args, "--out", str(dest)],
                           capture_output=True, text=True, timeout=600, env=os.environ)
        assert p.returncode == 0, p.stderr[-2000:]
        runs[name] = json.loads(dest.read_text())["benchmarks"]["rows"]
    assert runs["card"]["pass@1"] == pytest.approx(last["heldout_accuracy"], abs=1e-12)
    assert runs["card"]["pass@8"] == pytest.approx(last["heldout_pass@8"], abs=1e-12)
    # the control: sampled in float32 the same command reads other numbers, so the check above can fail
    assert (runs["float32"]["pass@1"], runs["float32"]["response_tokens"]) != \
        (runs["card"]["pass@1"], runs["card"]["response_tokens"])


@pytest.mark.parametrize("mode", ["skip", "truncate"])
def test_the_cards_command_reproduces_a_run_that_limited_its_prompts(tmp_path, shared_dir, hf_cache, mode,
                                                                    support_on_pythonpath):
    """data.max_prompt_tokens dropped or cut half the held-out prompts in training; the card's command evaluated all
    of them whole (card 0.8125, eval 0.6875). It now passes the limit, and eval applies it as training does."""
    from transformers import AutoTokenizer

    from trustbatch.data.benchmarks import load_benchmark

    model = shared_dir / "models" / "stories260K-hf"
    tok = AutoTokenizer.from_pretrained(model)
    held = [{**r, "problem": r["problem"] + " She counts them again and again." * k} for k, r in enumerate(ROWS[:8])]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[8:]))

    def tokens(path):  # each prompt as the run frames it (the MATH format's instruction included)
        return sorted(len(tok(e.prompt)["input_ids"]) for e in load_benchmark(str(path)).examples)

    lengths = tokens(tmp_path / "held.jsonl")
    limit = lengths[3]  # four held-out prompts are longer
    assert lengths[4] > limit and max(tokens(tmp_path / "train.jsonl")) <= limit
    run, out = tmp_path / "run", tmp_path / "export"
    cfg = load_config(None, RUN + [f"data={tmp_path / 'train.jsonl'}", f"data.heldout={tmp_path / 'held.jsonl'}",
                                   f"model.path={model}", f"run_dir={run}", f"data.max_prompt_tokens={limit}",
                                   f"data.long_prompts={mode}"])
    summary = train(cfg, console=QUIET)
    assert summary["heldout_prompts"] == (4 if mode == "skip" else 8)
    res = export_run(run, out)
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    dest = tmp_path / "eval.json"
    p = subprocess.run([sys.executable, "-m", "trustbatch", *res["eval_command"][1:], "--workers", "0", "--out",
                        str(dest)], capture_output=True, text=True, timeout=600, env=os.environ)
    assert p.returncode == 0, p.stderr[-2000:]
    again = json.loads(dest.read_text())["benchmarks"]["held"]
    assert again["prompts"] == summary["heldout_prompts"]
    assert again["pass@1"] == pytest.approx(last["heldout_accuracy"], abs=1e-12)
    assert again["pass@1_se"] == pytest.approx(last["heldout_accuracy_se"], abs=1e-12)


def test_a_lora_run_on_a_datasets_directory_exports_merged_weights(tmp_path, shared_dir, hf_cache):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "rows"))
    run, out, base = tmp_path / "run", tmp_path / "export", shared_dir / "models" / "stories260K-hf"
    cfg = load_config(None, RUN + [f"data={tmp_path / 'rows'}", f"model.path={base}", f"run_dir={run}",
                                   "model.lora.r=4", "model.lora.alpha=8"])
    assert train(cfg, console=QUIET)["heldout_prompts"] == 8
    res = export_run(run, out)
    assert res["lora"] and "-b" in res["eval_command"]
    ckpt = run / "checkpoints" / "step_000002"
    adapter, w0 = load_file(str(ckpt / "adapter_model.safetensors")), load_file(str(base / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(w0)
    expected = merged_by_hand(w0, adapter, 8 / 4)
    moved = [k for k in w0 if not torch.equal(expected[k], w0[k])]
    assert len(moved) > 4  # the adapters trained: B is 0 at the start
    for k in w0:
        torch.testing.assert_close(exported[k], expected[k], rtol=0, atol=1e-6)


def test_bad_input_is_one_line(tmp_path, parquet_run):
    run, out, _, _ = parquet_run
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "empty_run" / "config.yaml").write_text((run / "config.yaml").read_text())
    for args, says in (((tmp_path / "nowhere", tmp_path / "o1"), "is not a trustbatch run directory"),
                       ((tmp_path / "empty_run", tmp_path / "o2"), "has no checkpoint"),
                       ((run, out), "exists and is not an empty directory")):
        with pytest.raises(UserError, match=says):
            export_run(*args)
    p = subprocess.run([sys.executable, "-m", "trustbatch", "export", str(run), "--step", "1", "--out",
                        str(tmp_path / "o3")], capture_output=True, text=True, timeout=600)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "has no checkpoint at step 1; it keeps 0, 2" in lines[0], lines
    assert not (tmp_path / "o3").exists() and not list(tmp_path.glob(".o3*"))


def test_an_out_that_cannot_be_written_is_one_line_before_the_model_loads(tmp_path, parquet_run, monkeypatch):
    """Issue 46 item 2: an existing file, a path inside a file, a folder that cannot be made (/proc refuses it);
    the three commands run at once (each is a Python start)."""
    from runproc import one_line

    import trustbatch.policy

    run = parquet_run[0]
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    cases = {str(afile): "is a file, not a folder", str(afile / "model"): "lies inside", "/proc/1/no/model":
             "cannot write --out"}
    procs = {out: subprocess.Popen([sys.executable, "-m", "trustbatch", "export", str(run), "--out", out],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for out in cases}
    for out, says in cases.items():
        _, err = procs[out].communicate(timeout=600)
        line = one_line(err)
        assert procs[out].returncode == 2 and says in line and repr(out) in line, err
    assert afile.read_text() == "not a folder" and not list(tmp_path.glob(".*tmp-*"))
    monkeypatch.setattr(trustbatch.policy, "load_policy", lambda *a, **k: pytest.fail("the model loaded first"))
    for out, says in cases.items():
        with pytest.raises(UserError, match=says):
            export_run(run, out)


def test_a_chat_model_trains_on_its_template_with_the_system_prompt(tmp_path, shared_dir, hf_cache):
    """The wiring from the config: prepare_run frames the run's prompts (and a resumed full fine-tuning
    checkpoint's) with the chat template and data.system_prompt; the export's card and eval command say so."""
    from transformers import AutoTokenizer

    from trustbatch.policy import load_policy
    from trustbatch.recipes import prepare_run
    from trustbatch.recipes.build import restore_checkpoint_policy
    from trustbatch.recipes.export import eval_command, model_card

    chat = tmp_path / "chat-model"
    shutil.copytree(shared_dir / "models" / "stories260K-hf", chat)
    tok = AutoTokenizer.from_pretrained(chat)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    tok.save_pretrained(chat)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    cfg = load_config(None, RUN + [f"data={tmp_path / 'rows.parquet'}", f"model.path={chat}",
                                   "data.system_prompt=Count the apples."])
    task, policy, pool, _ = prepare_run(cfg)
    pool.close()
    text = task.train[0].prompt
    by_hand = f"[system] Count the apples.\n[user] {text}\n[assistant] "
    assert policy.encode_prompt(text) == tok(by_hand, add_special_tokens=False)["input_ids"]
    resumed = restore_checkpoint_policy(cfg, policy, None, load_policy(chat))
    assert resumed.encode_prompt(text) == policy.encode_prompt(text)
    cmd = eval_command(cfg, tmp_path / "export", 2)
    assert cmd[cmd.index("--system-prompt") + 1] == "Count the apples."
    assert "after the system message 'Count the apples.'" in model_card(cfg, tmp_path, tmp_path, 2, {}, cmd, chat=True)


def test_the_card_names_a_reward_model_term_without_its_local_path(tmp_path):
    """reward.functions' reward-model term is named rm:/path/to/dir: the card kept the whole absolute path (its
    other paths are given by their last component). Reference: the path as written, which must not appear."""
    from trustbatch.recipes.export import model_card

    where = "/home/someone/private/models/my-rm"
    cfg = load_config(None, ["data.train=/home/someone/data/rows.jsonl",
                             f"reward.functions=[{{name: 'rm:{where}', weight: 0.5}}, {{name: math}}]"])
    card = model_card(cfg, tmp_path, tmp_path, 2, {}, None)
    assert "/home/someone" not in card and "name: rm:my-rm" in card and "name: math" in card
