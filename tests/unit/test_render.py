"""The plan is data and the renderers agree: properties over generated plans, no hosts.

- a plan survives the manifest (to_dict, JSON, from_dict) and renders the same afterwards;
- every shell rendering (dry-run line, emitted script, sbatch, Kubeflow command), split as its
  shell (or the kubelet) splits it, gives exactly the argv the node's supervisor execs;
- a secret env value appears in no rendering of the masked plan, whatever it is.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch.runs import MASK, mask_plan
from ddpfab.planning import emit, export, render
from ddpfab.planning.plan import PLACEHOLDERS, Facts, Plan, RunOptions, make_plan

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
#: script arguments: any text, and placeholders (per node and job-wide)
ARG = st.one_of(TEXT, st.sampled_from([f"{{{{{p}}}}}" for p in PLACEHOLDERS]),
                st.builds(lambda a, p, b: f"{a}{{{{{p}}}}}{b}", TEXT, st.sampled_from(PLACEHOLDERS), TEXT))
UNIFORM_ARG = st.one_of(TEXT, st.sampled_from(["{{nnodes}}", "{{world_size}}", "{{master_port}}", "{{run_id}}",
                                               "--peer={{master_addr}}:{{master_port}}"]))
KEY = st.from_regex(r"[A-Z][A-Z0-9_]{0,8}", fullmatch=True).filter(lambda k: "TOKEN" not in k and "KEY" not in k)
PATH = st.from_regex(r"/[a-z][a-z0-9 '$_.-]{0,12}", fullmatch=True)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def plans(draw, uniform: bool = False, secret: str | None = None) -> Plan:
    """A plan from generated inputs; *uniform*: what a scheduler can start (one command for all)."""
    n = draw(st.integers(1, 4))
    python = draw(st.sampled_from(["python3", "/opt/venv/bin/python", "/opt/my env/python"]))
    workdir = draw(st.one_of(st.none(), PATH))
    nodes = []
    for i in range(1, n + 1):
        kw = {} if uniform else {"nproc": draw(st.one_of(st.none(), st.integers(1, 8))),
                                 "python": draw(st.sampled_from([python, "python3.11"])),
                                 "workdir": draw(st.one_of(st.none(), PATH))}
        nodes.append(Node(f"n{i}", f"10.0.0.{i}", python=kw.get("python", python),
                          workdir=kw.get("workdir", workdir), nproc=kw.get("nproc"), shared_dir="/nfs/x"))
    cluster = Inventory("inv.yml", "all", tuple(nodes))
    rdzv = "static" if uniform else draw(st.sampled_from(["static", "c10d"]))
    args = draw(st.lists(UNIFORM_ARG if uniform or rdzv == "c10d" else ARG, max_size=5))
    env = draw(st.lists(st.tuples(KEY, TEXT), max_size=3, unique_by=lambda kv: kv[0]))
    if secret is not None:
        env.append(("HF_TOKEN", secret))
    launcher = draw(st.sampled_from(["torchrun", "legacy"]))
    options = RunOptions(
        "train dir/t.py", args=tuple(args), env=tuple(env), run_id=draw(st.from_regex(r"[a-z0-9][a-z0-9_-]{0,8}",
                                                                                       fullmatch=True)),
        nproc_per_node=draw(st.one_of(st.none(), st.integers(1, 8))) if not uniform else 2,
        max_restarts=draw(st.integers(0, 3)), rdzv=rdzv, launcher=launcher,
        local_rank_arg=draw(st.sampled_from(["--local-rank", "--local_rank"])),
        init_method=draw(st.sampled_from(["env", "tcp", "file"])), debug=draw(st.booleans()))
    homes = draw(st.sampled_from([{}, {f"n{i}": "/home/u" for i in range(1, n + 1)}]))
    facts = Facts(addresses={f"n{i}": f"10.0.0.{i}" for i in range(1, n + 1)},
                  master_port=draw(st.integers(1, 65535)), cwd="/srv/proj", homes=homes)
    return make_plan(cluster, options, facts)


def as_shell_sees(cmd: render.Command) -> tuple[str, ...]:
    """*cmd*'s argv as a shell rendering means it: a relative log dir is under ``$HOME``."""
    log_dir = cmd.log_dir if cmd.log_dir.startswith("/") else f"$HOME/{cmd.log_dir}"
    return dataclasses.replace(cmd, log_dir=log_dir).argv()


def env_words(node) -> list[str]:
    return [f"{k}={v}" for k, v in node.env.items()]


# -- the manifest ---------------------------------------------------------------------------------
@SETTINGS
@given(plan=plans())
def test_a_plan_round_trips_through_the_manifest_and_renders_the_same(plan):
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan
    for a, b in zip(plan.nodes, back.nodes):
        assert render.argv(plan, a) == render.argv(back, b)
        assert render.shell_line(plan, a) == render.shell_line(back, b)
    # what a manifest records (masked) reads back as the masked plan
    assert Plan.from_dict(json.loads(json.dumps(mask_plan(plan.to_dict())))) == render.masked(plan)
    assert "argv" not in json.dumps(plan.to_dict()) and "command" not in plan.to_dict()["nodes"][0]


# -- the renderers agree ----------------------------------------------------------------------------
@SETTINGS
@given(plan=plans())
def test_the_dry_run_line_and_the_emitted_script_split_into_the_nodes_argv(plan):
    for node in plan.nodes:
        cmd = render.command(plan, node)
        assert render.argv(plan, node) == cmd.argv()
        words = shlex.split(render.shell_line(plan, node))
        assert words == ["cd", node.workdir, "&&", "env", *env_words(node), *as_shell_sees(cmd)]
        text = emit.node_script(plan, node)
        # after `set -eu`: the cd line, an export per variable, then the exec command (a value or
        # an argument may hold a newline: each line is one shell command of its own)
        lines = render.script_lines(plan, node)
        assert text.split("\nset -eu\n", 1)[1] == "\n".join(lines) + "\n"
        assert shlex.split(lines[0]) == ["cd", node.workdir]
        assert [shlex.split(line) for line in lines[1:-1]] == [["export", w] for w in env_words(node)]
        assert shlex.split(lines[-1]) == ["exec", *as_shell_sees(cmd)]


def srun_words(text: str) -> list[str]:
    """The srun command of an sbatch script (the script's last command: its line and two
    continuation lines, whose words may span lines), as bash splits it."""
    section = text[text.index("\nsrun ") + 1:]
    return shlex.split(section.replace(" \\\n    ", " ", 2))


@SETTINGS
@given(plan=plans(uniform=True))
def test_the_sbatch_script_starts_each_node_with_exactly_its_argv(plan):
    text = export.to_sbatch(plan)
    words = srun_words(text)
    at = words.index("ddpfab-node")
    inner, outer = shlex.split(words[at - 1]), words[at + 1:]
    # the inner command: exec the first words, then Slurm's rendezvous, then the rest
    refs = render.Rendezvous("$SLURM_NODEID", "$MASTER_ADDR", "$MASTER_PORT")
    cut = int(re.fullmatch(r"\$\{@:1:(\d+)\}", inner[1]).group(1))
    assert inner == ["exec", inner[1], *render.static_rendezvous(refs), f"${{@:{cut + 1}}}"]
    started = outer[:cut] + list(render.static_rendezvous(refs)) + outer[cut:]
    # the ranks' environment: one export per variable, a value may span lines
    block = text.split("# the environment of every rank (srun passes it on to each task)\n", 1)[1]
    exports = shlex.split(block.split("\n# master: ", 1)[0])
    for node in plan.nodes:
        assert tuple(started) == as_shell_sees(render.command(plan, node, refs))
        assert exports == [w for kv in env_words(node) for w in ("export", kv)]
    assert shlex.split(next(ln for ln in text.split("\n") if ln.startswith("cd -- ")))[2] == \
        (plan.nodes[0].workdir if plan.nodes[0].workdir.startswith("/") else f"$HOME/{plan.nodes[0].workdir}")


_K8S_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubelet(word: str, env: dict[str, str]) -> str:
    """What the kubelet makes of a container's command word: ``$$`` is ``$``, ``$(VAR)`` expands."""
    return _K8S_REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), word)


@SETTINGS
@given(plan=plans(uniform=True))
def test_the_kubeflow_containers_start_each_node_with_exactly_its_argv(plan):
    job = export.to_pytorchjob(plan, image="img", python="/usr/bin/python3")
    for rtype, spec in job["spec"]["pytorchReplicaSpecs"].items():
        (container,) = spec["template"]["spec"]["containers"]
        ranks = [0] if rtype == "Master" else range(1, plan.nnodes)
        for rank in ranks:
            operator = {"RANK": str(rank), "MASTER_ADDR": "job-master-0", "MASTER_PORT": str(plan.master_port)}
            got = [kubelet(w, operator) for w in container["command"] + container["args"]]
            node = plan.nodes[rank]
            want = render.command(plan, node, render.Rendezvous(str(rank), "job-master-0", str(plan.master_port)))
            assert got == ["/usr/bin/python3", *(w for w in want.argv()[1:] if not w.startswith("--log-dir="))]
            assert {e["name"]: kubelet(e["value"], {}) for e in container["env"]} == node.env
    trainer = export.to_trainjob(plan, image="img")["spec"]["trainer"]
    pet = {"PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "29400"}
    want = render.command(plan, plan.nodes[-1], render.Rendezvous("1", "m", "29400"))
    assert [kubelet(w, pet) for w in trainer["command"] + trainer["args"]] == \
        ["python3", *(w for w in want.argv()[1:] if not w.startswith("--log-dir="))]


# -- masking ----------------------------------------------------------------------------------------
SECRET = st.text(min_size=1, max_size=16).map(lambda t: f"s3cr3t{t}")


@SETTINGS
@given(data=st.data(), secret=SECRET)
def test_no_rendering_of_a_masked_plan_shows_a_secret_value(data, secret):
    plan = data.draw(plans(secret=secret))
    without = dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, env={}) for n in plan.nodes))
    assume(secret not in json.dumps(without.to_dict(), ensure_ascii=False))  # shown elsewhere as itself
    shown = render.masked(plan)
    texts = [json.dumps(mask_plan(plan.to_dict()), ensure_ascii=False), shown.to_json(), emit.readme(shown)]
    for node in shown.nodes:
        texts += [render.shell_line(shown, node), emit.node_script(shown, node), " ".join(render.argv(shown, node))]
        assert node.env["HF_TOKEN"] == MASK
    try:
        texts += [export.to_sbatch(shown), json.dumps(export.to_pytorchjob(shown, image="i"), ensure_ascii=False),
                  json.dumps(export.to_trainjob(shown, image="i"), ensure_ascii=False)]
    except export.ExportError:
        pass  # a plan a scheduler cannot start: nothing rendered
    quoted = {secret, shlex.quote(secret), json.dumps(secret, ensure_ascii=False)[1:-1], secret.replace("$", "$$")}
    for text in texts:
        assert not any(q in text for q in quoted)
    assert any(q in render.shell_line(plan, plan.nodes[0]) for q in (shlex.quote(f"HF_TOKEN={secret}"),))


@SETTINGS
@given(plan=plans(secret="hf_SECRET"))
def test_an_emitted_script_puts_no_env_value_on_a_command_line(plan):
    """``exec env K=V ...`` showed the value in the env program's argv (``ps``) until it exec'd."""
    for node in plan.nodes:
        for line in render.script_lines(plan, node):
            if "hf_SECRET" in line:
                assert shlex.split(line)[0] == "export", line
