#!/usr/bin/env python3
"""boris.py - an MCP server that gives an AI agent a coding workspace.

Shell, file view/edit/create, content and name search, workspace file tools and
web fetch, in one Python file with no dependencies (Python 3.8+, standard library).

    python3 boris.py                      # serve MCP over stdio (the default)
    python3 boris.py --transport http     # serve streamable HTTP on 127.0.0.1:8080/mcp
    python3 boris.py --help               # every flag, with its environment variable

The file reads top to bottom as layers, each under a banner, each using only
the layers above it:

    Limits and constants     every number a user or a model can meet
    Errors                   the error codes, ToolError, the log
    Configuration            FLAGS (flag, env, default, kind, help), parse_config, --help
    Paths                    PathPolicy: resolve, then check allow/deny (case as the
                             volume folds it)
    Files                    the one opener, the one atomic writer, line reading, sniffing
    Child processes          spawn, the reaper, killing a group, run_program (a program
                             run to its end); helper processes (this file run again)
    Sandbox                  Landlock, seccomp, network namespaces, the launchers that
                             confine commands, the egress proxy of a domain list
    Search                   ignore rules, inotify watches and the walk cache, one walker,
                             the grep and outline engines
    Documents                office documents and PDF as text, read in helpers
    Helpers                  the searches run in helpers (where a deadline or a cancel can
                             kill them), the helper pool
    Shell                    Capture, and the command runner: start_process, pump, Task
    Language servers         the verdict after an edit: LangServer, LangServers, lsp_words
    Web                      fetch with vetted addresses, HTML to Markdown, coded fetch
                             errors
    Session                  one client's cwd, viewed files, tasks (admitted here), undo
                             history
    Checkpoints              the store, git's index, the session's checkpoints of the
                             workspace
    Tools: building blocks   the registry (@tool), schema builders, CallContext, the
                             pieces answers share
    Tools: images and notebooks  what such a file shows a model in view
    Tools: view              view of files, directories, images and notebooks
    Tools: outline           a file's definitions with line ranges, or a directory's
                             files' top-level ones
    Tools: edits             the one matcher and the three-way merge (EditMerge), the one
                             edit writer (write_edit), then str_replace, multi_edit,
                             create_file, undo_edit, checkpoints and rewind, and the
                             compat editor
    Tools: apply_patch       Codex's patch format, read, planned, written all or none
    Tools: notebooks         notebook_edit
    Tools: shell             bash (handed off to the background when it outlives
                             --handoff) and the task tools
    Tools: search            grep, glob, search_text, search_files
    Tools: workspace         read_file, write_file, list_directory, web_fetch
                             (fixed Chinese answers)
    Protocol                 McpServer: JSON-RPC dispatch, argument checks, the worker
                             pool
    Transports               stdio, and streamable HTTP (sessions, auth, CORS)
    main                     flags to config, policy and sandbox; serve; a helper
                             process's main

A test (TestTheFilesMap) keeps it so: no name is used above the section or
sub-banner that defines it, and this list names the sections there are. Beyond that
order, one of each: one resolver (Paths), one opener and one writer (Files: a helper
gets the checked descriptor, not a path), one way to start a process (Child processes),
one walker (Search), one matcher and one edit writer (Tools: edits), one error path
(ToolError). Tools return their answers and never print; transports never open files.

A tool's description, schema and handler stand together in its section, registered by
@tool where they are defined: adding a tool touches one section. Heavy standard-library
modules that only some calls need are imported inside the functions that use them.

The tools, in listing order. Each one's handler is tool_<name>, next to its @tool
(description and schema); the engine is what the handler leaves the work to, the job
the helper job it runs (Helpers: an "op"), the tests the class that drives it most
(TestTheFilesMap checks every tool is here and every name below exists):

    tool                engine                              job       tests
    view                numbered, list_tree, image_result,  document, TestView
                        Notebook, document_view, pdf_view   pdf
    outline             Outline, directory_outline          outline   TestOutline
    str_replace         replace_text, write_edit            -         TestStrReplace
    multi_edit          replace_text, write_edit            -         TestMultiEdit
    create_file         write_edit                          -         TestCreateFile
    undo_edit           write_edit, bytes_before            -         TestUndoEdit
    checkpoints         Checkpoints, checkpoint_diff        -         TestRewind
    rewind              Checkpoints.rewind                  -         TestRewind
    str_replace_editor  tool_view and the edit tools        -         TestCompatEditor
    apply_patch         PatchReader, PatchPlan, write_edit  -         TestApplyPatch
    notebook_edit       Notebook, write_edit                -         TestNotebooks
    bash                start_command, Task                 -         TestBash
    task_output         await_task, OutputWatch             match     TestBackgroundTasks
    task_input          Task.write                          -         TestInteractiveTasks
    task_stop           kill_all                            -         TestBackgroundTasks
    grep                GrepWork, grep_answer               grep      TestGrep
    glob                find_paths                          glob      TestGlob
    search_text         GrepWork, format_records            grep      TestSearchText
    search_files        find_paths                          glob      TestSearchFiles
    read_file           read_regular, line_window           -         TestWorkspaceTools
    write_file          write_edit                          -         TestWorkspaceTools
    list_directory      list_entries                        -         TestWorkspaceTools
    web_fetch           WebFetch, HtmlToMarkdown            -         TestWebFetch

Under --anthropic-compat, grep is tool_grep under Claude Code's parameter names
(renamed()), and str_replace_editor stands for view and the edit tools.

House words, one meaning each:
    helper          this file run again as a child process, for a job that may have
                    to be killed (a search, a document read); Helpers holds the pool
    lane            a session's queue in the worker pool: "shell" (commands, and
                    calls that wait) or "quick" (the rest): no quick call waits
                    behind a command
    slice, dealt    a directory search is dealt out in slices, one per helper
                    (SEARCH_SLICES); each walks only its slice of the tree
                    (Walker.deal)
    the turn        the checkpoint store's one walk at a time: the scanning
                    thread's, or that of a call that holds it (checkpoints, rewind)
    read-on notice  the line that ends a cut answer, giving the offset (or
                    start_index) to call again with to read on
    a lack          what this place does not have: a module this Python was built
                    without, or a refusal by the system; lacking() words it as a
                    coded answer, never a crash
    plain error     a ToolError rendered verbatim, without [CODE] (the workspace tools)

History. boris.py re-implements boris, an MCP server written in Go ("the Go original",
"the original boris"): where a comment says "as the original boris", this file keeps that
server's behaviour (grep's `--` between groups, the order of the instructions' lines).
The workspace tools (read_file, write_file, list_directory, web_fetch) answer a separate
requirement written in Chinese (seed 004 of the requirements boris is built from): its
scenarios fix each answer, such as 错误：路径越出工作区限制 (a path outside
the workspace), so these tools answer in those strings byte for byte, and an answer
starting with 错误 ("error") is an error.

Constants follow one rule: a number a user or a model can meet (a limit, a size, a
timeout, in an answer, a message or a flag) is at the top, under Limits; one that only
tunes how one layer works inside (buffers, batches, cache sizes) sits at the
head of that layer's banner. Every other piece of state belongs to an object that the
server (or a helper's main) makes and passes down, but for these, each saying why where
it is defined (TestTheFilesMap keeps the list true):

Module-level objects that change after the file has loaded: _log_state (the log's level
and format), _children (the process's children and its reaper), PDF_NAMES (glyph names,
read at first use) and pdf_libcrypto's cache (loaded at first use); TOOLS is filled while
the file loads.

License: MIT.
"""

__version__ = "0.1.0"
__license__ = "MIT"

import sys

if __name__ == "__main__" and sys.path and not (sys.flags.isolated
                                                 or getattr(sys.flags, "safe_path", False)):
    # sys.path[0] is this file's directory (or the cwd, for -m): often the workspace,
    # where a model can write json.py or difflib.py. Drop it before the first import,
    # so that every module, now and imported lazily later, comes from the standard library.
    del sys.path[0]

if sys.version_info < (3, 8):
    sys.stderr.write("boris: error: Python %d.%d is too old; boris.py needs Python 3.8 or newer\n"
                     % sys.version_info[:2])
    sys.exit(2)

import argparse
import atexit
import codecs
import contextlib
import errno
import functools
import gc
import heapq
import io
import json
import math
import os
import posixpath
import re
import select
import signal
import stat
import struct
import threading
import time
import queue
from bisect import bisect_left, bisect_right
from collections import Counter, OrderedDict, defaultdict, deque, namedtuple
from array import array
from itertools import compress, groupby, repeat
from operator import attrgetter, is_, itemgetter, methodcaller

# This file's path, read once: CPython takes __file__ out of a script's globals when its top
# level ends, and the server serves on after that (serve_after_the_script). None when the
# code came from no file (then no helper process can run it).
THIS_FILE = os.path.abspath(__file__) if globals().get("__file__") else None

###############################################################################
# Limits and constants ########################################################
###############################################################################

SERVER_NAME = "boris"
# The first line of `instructions` says what the server is: Codex shows a deferred server to
# its model by this line alone, and its tool search looks for tools in it.
INSTRUCTIONS_FIRST_LINE = ("boris: coding workspace - shell, view/edit files, grep/glob search,"
                           " web fetch")
PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
MODERN_VERSIONS = ("2026-07-28",)          # stateless revision: server/discover
# the one list server/discover and every refusal give
SUPPORTED_VERSIONS = MODERN_VERSIONS + PROTOCOL_VERSIONS
META_VERSION_KEY = "io.modelcontextprotocol/protocolVersion"
CLIENT_INFO_KEY = "io.modelcontextprotocol/clientInfo"
CLIENT_CAPS_KEY = "io.modelcontextprotocol/clientCapabilities"
SERVER_INFO_KEY = "io.modelcontextprotocol/serverInfo"
LOG_LEVEL_KEY = "io.modelcontextprotocol/logLevel"
# the methods the 2026 revision removed
REMOVED_METHODS = ("initialize", "ping", "logging/setLevel", "resources/subscribe",
                   "resources/unsubscribe")
UNSUPPORTED_PROTOCOL_VERSION = -32022
HEADER_MISMATCH = -32020

VIEW_MAX_LINES = 2000                      # lines shown by view without a range
VIEW_MAX_LINE_CHARS = 2000                 # longer lines are cut
IMAGE_MAX_BYTES = 5 * 1024 * 1024          # the largest image a model API takes
CLAUDE_INLINE_CHARS = 50000                # a tool result Claude Code keeps
                                           # inline unless a tool says more
IMAGE_MAX_SIDE = 8000                      # pixels, either side
SNIFF_BYTES = 8192                         # header read for binary/image sniffing
LISTING_DEPTH = 2                          # view of a directory
LISTING_MAX_ENTRIES = 1000
SKIP_DIRS = frozenset((".git", "node_modules"))     # never listed by view nor walked by a search
MISS_CONTEXT_LINES = 60                    # lines of the closest region a str_replace miss shows
MISS_WINDOW_LINES = 60                     # the closest-match help locates
                                           # old_str by this many lines
MISS_CANDIDATES = 20                       # ... scores this many candidate places
MISS_SCAN_LINES = 50000                    # ... and compares at most this many lines one by one
SNIPPET_CONTEXT = 4                        # lines around an edit in str_replace's answer
UNDO_LEVELS = 20                           # undo_edit: the edits of one
                                           # file a session can take back
UNDO_MAX_BYTES = 64 * 1024 * 1024          # ... and the bytes all its undo
                                           # levels may hold (oldest dropped)
CHECKPOINTS_KEPT = 100                     # checkpoints a session keeps (the oldest go first) ...
CHECKPOINT_ENTRIES = 2000000               # ... and the entries all of them
                                           # may list (~100 bytes each)
CHECKPOINT_WALK_MAX = 1000000              # entries one checkpoint walks;
                                           # past it the rest is not covered
CHECKPOINT_BUDGET_AUTO = 2 << 30           # --checkpoint-budget auto: this, or
                                           # a quarter of the store's free space
CHECKPOINT_NAMES_SHOWN = 20                # paths named per kind of change
                                           # in checkpoints and rewind
CHECKPOINT_WAIT_S = 1.5                    # a call waits this long for a
                                           # checkpoint; then it keeps what it has
CHECKPOINT_FIRST_S = 1.0                   # the first checkpoint starts this long after
                                           # the session (or sooner, at its first changing
                                           # call): start-up and the first answers go first
PARSE_CHECK_BYTES = 1024 * 1024            # files up to this size are parsed after an edit
MAX_PATH_CHARS = 4096
MAX_PATTERN_CHARS = 8192                   # a regex, glob, include or wait_for from the model
MAX_INT_ARG = 2 ** 53 - 1                  # integers beyond this are not JSON-safe in every client
MAX_BRACE_DEPTH = 16                       # {a,{b,c}} nesting in a glob
MAX_SYMLINKS = 40                          # links followed in one path, as the kernel's ELOOP

MIN_RESULT_CHARS = 4000                    # --max-result-chars range; the default is 40,000:
MAX_RESULT_CHARS = 1000000                 # Claude Code spills results over 50,000 to a file,
                                           # Gemini keeps 40,000
OUTPUT_MAX_CHARS = 30000                   # bash stdout/stderr, grep, glob output
BASH_MAX_TIMEOUT_MS = 600000
KILL_GRACE_S = 5.0                         # SIGTERM -> SIGKILL
EOF_GRACE_S = 2.0                          # stdin closed, or the session: calls in flight
                                           # get this long to end
MAX_BACKGROUND_TASKS = 10
PROGRESS_INTERVAL_S = 0.1                  # at most ~10 progress notifications a second
PROGRESS_LINE_CHARS = 200                  # a progress message shows the last line cut to this
WAIT_FOR_LINE_CHARS = 1000                 # of each output line, what wait_for looks at

SEARCH_TIMEOUT_S = 60.0                    # a search is stopped here, its partial results kept
GREP_HEAD_LIMIT = 0                        # grep's page when a call gives no head_limit (0: all)
DOC_MEMBER_BYTES = 64 << 20                # view of an office document: a part
                                           # of it inflated past this is refused
DOC_MAX_CELLS = 200000                     # ... and a spreadsheet's cells
                                           # past this are left out, saying so
WEB_MAX_CHARS = 5000
WEB_MAX_BYTES = 5 * 1024 * 1024
WEB_MAX_REDIRECTS = 5
WEB_TIMEOUT_S, WEB_MAX_TIMEOUT_S = 10, 120  # web_fetch's timeout argument: default, most
MAX_URL_CHARS = 8192

HTTP_SESSION_IDLE_S = 600.0
HTTP_MAX_BODY = 4 * 1024 * 1024
HTTP_MAX_CONNECTIONS = 256                 # more at once get 503 (each holds a thread and an fd)
HTTP_READ_TIMEOUT_S = 30.0                 # a request's headers and body must arrive within this
STDIO_MAX_LINE = 64 * 1024 * 1024          # one stdio message at most
MAX_WORKERS = 64                           # tool calls running at once; more wait in a queue
SESSION_MAX_RUNNING = 16                   # ... of them one session's in each lane
                                           # (shell commands, and the quick tools beside
                                           # them); a lane's first call always starts

###############################################################################
# Errors ######################################################################
###############################################################################


# The error codes a tool answers with, `[CODE] message` (ToolError.render). Each is
# named once here, so a misspelt one is an undefined name (pyflakes), not a new code.
INVALID_INPUT = "INVALID_INPUT"                  # an argument the schema or the tool refuses
ACCESS_DENIED = "ACCESS_DENIED"                  # outside --allow-dir, inside --deny-dir
PATH_NOT_FOUND = "PATH_NOT_FOUND"
IO_ERROR = "IO_ERROR"                            # the system refused, or a helper failed
FILE_TOO_LARGE = "FILE_TOO_LARGE"                # over --max-file-size
FILE_NOT_VIEWED = "FILE_NOT_VIEWED"              # view-before-edit
FILE_CHANGED = "FILE_CHANGED"                    # changed on disk since this session saw it
STR_REPLACE_NOT_FOUND = "STR_REPLACE_NOT_FOUND"
STR_REPLACE_AMBIGUOUS = "STR_REPLACE_AMBIGUOUS"
GREP_INVALID_PATTERN = "GREP_INVALID_PATTERN"
GREP_INVALID_TYPE = "GREP_INVALID_TYPE"
GREP_INVALID_OUTPUT_MODE = "GREP_INVALID_OUTPUT_MODE"
GLOB_INVALID_PATTERN = "GLOB_INVALID_PATTERN"
GLOB_INVALID_TYPE = "GLOB_INVALID_TYPE"
BASH_EMPTY_COMMAND = "BASH_EMPTY_COMMAND"
BASH_START_FAILED = "BASH_START_FAILED"
BASH_TASK_NOT_FOUND = "BASH_TASK_NOT_FOUND"
BASH_TASK_LIMIT = "BASH_TASK_LIMIT"
BASH_TASK_NOT_INTERACTIVE = "BASH_TASK_NOT_INTERACTIVE"
# the codes: the module's globals named as they are spelt (the constants above)
ERROR_CODES = frozenset(value for name, value in list(globals().items()) if name == value)


class ToolError(Exception):
    """The one way a tool fails: a code and a message the model can act on.

    render() is the one place an error becomes text: `[CODE] message.`, or the message
    verbatim for the workspace tools (`plain`), which answer in fixed Chinese strings."""

    def __init__(self, code, message, plain=False, detail=None):
        Exception.__init__(self, message)
        if code not in ERROR_CODES:
            raise ValueError("unknown error code %r" % (code,))
        self.code = code
        self.message = message
        self.plain = plain
        self.detail = detail            # for callers that word it their own way: a limit, "swapped"

    def render(self):
        """The error as the model reads it (see the class docstring)."""
        if self.plain:
            return self.message
        msg = self.message.rstrip()
        if "\n" not in msg and not msg.endswith((".", "?", "!")):
            msg += "."
        return "[%s] %s" % (self.code, msg)


def plain_error(message, code=IO_ERROR):
    """A workspace tool's error: its fixed Chinese string, shown verbatim."""
    return ToolError(code, message, plain=True)


def lacking(e):
    """The ToolError for what this place lacks, where a tool did not word it itself: a module
    this Python was built without (ImportError), or a refusal by the system (OSError: a
    read-only filesystem, a full disk) or a nesting deeper than Python's recursion limit.
    Its traceback goes to the log at debug: the model's answer never shows it."""
    log("debug", "a tool met an error it did not word", error=_traceback())
    if isinstance(e, RecursionError):
        return ToolError(INVALID_INPUT,
                         "what was read nests too deeply for Python to parse (%s)" % e)
    if isinstance(e, ImportError):
        return ToolError(IO_ERROR, "this needs Python's %s module, which this Python was built"
                         " without: run boris.py with a Python that has it"
                         % (e.name or str(e)).lstrip("_"))
    where = ": %s" % e.filename if e.filename else ""
    if e.errno == errno.EROFS:
        return ToolError(IO_ERROR,
                         "the filesystem is read-only%s; nothing can be changed there" % where)
    return ToolError(IO_ERROR, "the system refused (%s)%s" % (e.strerror or e, where))


class RpcError(Exception):
    """A JSON-RPC error answer (protocol layer only: bad params of a non-tool method)."""

    def __init__(self, code, message):
        Exception.__init__(self, message)
        self.code = code
        self.message = message


class ConfigError(Exception):
    """A bad flag or environment value: one line on stderr, exit code 2."""


def shorten(text, most=200):
    """`text` for a message: whole, or its first `most` characters and its length."""
    return text if len(text) <= most else "%s... (%d characters)" % (text[:most], len(text))


def human_size(n):
    """1536 -> '1.5 KB'; the form used in every size message."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return "%d %s" % (n, unit) if unit == "bytes" else "%.1f %s" % (n, unit)
        n /= 1024.0


def plural(n, word):
    """'1 file', '2 files': a count and its noun, in every message that counts."""
    return "%d %s%s" % (n, word, "" if n == 1 else "s")


_LOG_LEVELS = {"debug": 10, "info": 20, "warn": 30, "error": 40}
# A module-level object that changes at run time (the module docstring lists them all):
# the process has one stderr, and main() sets how it is written to once, before serving.
_log_state = {"level": 20, "format": "text"}
_log_lock = threading.Lock()


def _traceback():
    """The exception being handled, as its traceback text (for an error log line)."""
    import traceback
    return traceback.format_exc()


def log(level, message, **fields):
    """Write one log line to stderr (never stdout: stdout carries the protocol)."""
    if _LOG_LEVELS[level] < _log_state["level"]:
        return
    if _log_state["format"] == "json":
        line = json.dumps(dict({"time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                "level": level.upper(), "msg": message}, **fields), default=str)
    else:
        extra = "".join(" %s=%s" % (k, json.dumps(v, default=str)) for k, v in fields.items())
        line = "%s %s boris: %s%s" % (time.strftime("%H:%M:%S"), level.upper(), message, extra)
    with _log_lock:
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass  # stderr closed or broken: a log line cannot go anywhere else

###############################################################################
# Configuration ###############################################################
###############################################################################

# (flag, env, default, kind, help). Kinds: str, choice:<a|b>, port, seconds, size, chars,
# budget, bool, tristate, list. The table drives parsing, env fallback and --help alike.
FLAGS = (
    ("transport", "BORIS_TRANSPORT", "stdio", "choice:stdio|http", "transport to serve"),
    ("host", "BORIS_HOST", "127.0.0.1", "str", "HTTP bind address"),
    ("port", "BORIS_PORT", "8080", "port", "HTTP port"),
    ("workdir", "BORIS_WORKDIR", ".", "str",
     "starting cwd and the workspace root of read_file/write_file/list_directory"),
    ("timeout", "BORIS_TIMEOUT", "120", "seconds", "default bash timeout in seconds"),
    ("handoff", "BORIS_HANDOFF", "50", "seconds",
     "a foreground bash command still running after this long becomes a background task: the"
     " call returns its output so far and the task id (0 = never; clients give up on a call after"
     " ~60 s)"),
    ("allow-dir", "BORIS_ALLOW_DIRS", "", "list",
     "directory the file tools may touch (repeatable; env comma-separated; none = all)"),
    ("deny-dir", "BORIS_DENY_DIRS", "", "list",
     "directory or glob the file tools may not touch, e.g. '**/.env' (repeatable)"),
    ("token", "BORIS_TOKEN", "", "str",
     "bearer token required by the HTTP transport (on the command line other users see it in ps:"
     " prefer BORIS_TOKEN or --token-file)"),
    ("token-file", "BORIS_TOKEN_FILE", "", "str",
     "read the HTTP bearer token from this file's first line"),
    ("shell-env-keep", "BORIS_SHELL_ENV_KEEP", "", "list",
     "environment variables bash commands get although they are boris's own (BORIS_*) or named"
     " like a secret (KEY, SECRET, TOKEN, PASSWORD, PASSWD, CREDENTIAL); names or shell globs,"
     " '*' for all (repeatable)"),
    ("shell-env-drop", "BORIS_SHELL_ENV_DROP", "", "list",
     "more environment variables bash commands do not get (names or shell globs, repeatable)"),
    ("generate-token", "BORIS_GENERATE_TOKEN", "false", "bool",
     "generate a bearer token and print it to stderr (HTTP)"),
    ("disable-tools", "BORIS_DISABLE_TOOLS", "", "list",
     "tool names not to register (repeatable or comma-separated)"),
    ("always-load", "BORIS_ALWAYS_LOAD", "view,str_replace,str_replace_editor,bash,grep,glob",
     "list",
     "tools Claude Code loads from the first turn instead of deferring them to its tool search"
     " (anthropic/alwaysLoad in tools/list); 'none' for none"),
    ("background-task-timeout", "BORIS_BACKGROUND_TASK_TIMEOUT", "0", "seconds",
     "kill background tasks running longer than this (0 = never)"),
    ("max-file-size", "BORIS_MAX_FILE_SIZE", "10MB", "size",
     "largest file read or written (e.g. 512KB, 10MB, 1GB, bytes)"),
    ("checkpoint-budget", "BORIS_CHECKPOINT_BUDGET", "auto", "budget",
     "bytes the workspace checkpoints (rewind) may keep in the server's private store (the temp"
     " directory, or ~/.cache/boris where the temp directory is a tmpfs): a size, auto (2GB or a"
     " quarter of the store's free space, the smaller) or off"),
    ("require-view-before-edit", "BORIS_REQUIRE_VIEW_BEFORE_EDIT", "auto", "tristate",
     "edits need a prior view of the file: auto|true|false"),
    ("anthropic-compat", "BORIS_ANTHROPIC_COMPAT", "false", "bool",
     "expose str_replace_editor and Claude Code's grep parameter names"),
    ("log-level", "BORIS_LOG_LEVEL", "info", "choice:debug|info|warn|error", "stderr log level"),
    ("log-format", "BORIS_LOG_FORMAT", "text", "choice:text|json", "stderr log format"),
    ("web-fetch-allow", "BORIS_WEB_FETCH_ALLOW", "", "list",
     "the only domains web_fetch may reach, e.g. docs.python.org or *.example.org (its"
     " subdomains); an IP address then never (repeatable; none = any)"),
    ("web-fetch-block-private", "BORIS_WEB_FETCH_BLOCK_PRIVATE", "false", "bool",
     "web_fetch also refuses loopback and private addresses (link-local is always refused)"),
    ("max-result-chars", "BORIS_MAX_RESULT_CHARS", "40000", "chars",
     "longest tool result in characters; a cut one says first and last how to read on (clients"
     " cut at 40-50k)"),
    ("svg", "BORIS_SVG", "auto", "choice:auto|image|text",
     "SVG files as image content or as their source text; auto: text for Claude, Codex and"
     " Gemini clients"),
    ("lsp", "BORIS_LSP", "", "list",
     "the language server of a language, LANGUAGE=COMMAND (python, typescript, c, go, rust,"
     " shell), e.g. 'python=pylsp'; 'off' for none; a language not named gets the first of its"
     " usual servers on PATH (repeatable)"),
    ("lsp-wait", "BORIS_LSP_WAIT", "1.5", "seconds",
     "how long an edit waits for its language server's verdict before it answers"),
    ("sandbox", "BORIS_SANDBOX", "auto", "choice:auto|off|workspace-write|read-only",
     "confine bash with the kernel (Landlock): writes only under --allow-dir (or --workdir) and"
     " the temp directory, or nowhere but temp; auto: workspace-write when --allow-dir is given"
     " and the kernel can"),
    ("sandbox-network", "BORIS_SANDBOX_NETWORK", "", "list",
     "whether sandboxed commands may use the network (TCP, UDP, Unix sockets outside the"
     " sandbox): on, off (the default when sandboxed), or the only domains they may reach (e.g."
     " pypi.org,*.pythonhosted.org), through a loopback HTTP(S) proxy boris runs, which web_fetch"
     " then keeps to as well"),
    ("sandbox-protect", "BORIS_SANDBOX_PROTECT", "", "list",
     "paths sandboxed commands may read but never change although they are under a writable"
     " root: a name (looked for at the top of each workspace root and of its subdirectories) or"
     " an absolute path, added to the defaults; 'none' protects nothing (repeatable)"),
)
# What --help says a default does where the flag's own default value does not say it
# (a test holds each to what the code does)
HELP_DEFAULTS = {"allow-dir": "none: every directory", "deny-dir": "none",
                 "lsp": "the usual servers on PATH",
                 "sandbox-network": "off when sandboxed",
                 "sandbox-protect": ".git, .hg, .svn, boris.py"}

# The words a bool flag takes (a tristate's `auto` is true in this release)
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True,
               "0": False, "false": False, "no": False, "off": False}


class Config(argparse.Namespace):
    """Resolved settings, made by parse_config: one attribute per FLAGS row (dashes as
    underscores), every value typed. `auto` is decided here but for svg (per client, by
    svg_as_text), sandbox (by resolve_sandbox) and checkpoint_budget (None: by the store);
    sandbox_network is None (the sandbox decides), True, False or a list of domains."""


def parse_size(text):
    """Bytes of a size such as 10MB, 512KB or 1G (units
    of 1024); ValueError saying what is expected."""
    m = re.match(r"^\s*(\d+)\s*([KMG]?)B?\s*$", text, re.IGNORECASE)
    if not m:
        raise ValueError("expected a size such as 10MB, 512KB, 1GB or a number of bytes")
    return int(m.group(1)) * {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}[m.group(2).upper()]


def parse_budget(text):
    """A budget's bytes: a size (0 is off), 'off' (0)
    or 'auto' (None: worked out where it is used)."""
    word = text.strip().lower()
    if word in ("off", "auto"):
        return 0 if word == "off" else None
    try:
        return parse_size(text)
    except ValueError:
        raise ValueError("expected a size such as 512MB or 2GB, auto or off")


def word_value(text, words, expected):
    """words[text lower-cased], else ValueError(expected)."""
    try:
        return words[text.lower()]
    except KeyError:
        raise ValueError(expected)


def in_range(value, low, high, expected):
    """value if low <= value <= high (NaN is not), else ValueError(expected)."""
    if not low <= value <= high:
        raise ValueError(expected)
    return value


# Flag kind -> its parser (text -> value, or ValueError saying what was expected).
_PARSERS = {
    "str": lambda text: text,
    "port": lambda text: in_range(int(text), 1, 65535, "expected a port from 1 to 65535"),
    "seconds": lambda text: in_range(float(text), 0, float("inf"),
                                     "expected a number of seconds >= 0"),
    "chars": lambda text: in_range(int(text), MIN_RESULT_CHARS, MAX_RESULT_CHARS,
                                   "expected a number of characters from %d to %d"
                                   % (MIN_RESULT_CHARS, MAX_RESULT_CHARS)),
    "size": lambda text: in_range(parse_size(text), 1, float("inf"), "expected a size above 0"),
    "budget": parse_budget,
    "bool": lambda text: word_value(text, _BOOL_WORDS, "expected true or false"),
    "tristate": lambda text: word_value(text, dict(_BOOL_WORDS, auto=True),
                                        "expected true or false or auto"),
}


def flag_value(kind, raws):
    """A flag's typed value from the raw strings given for it: a list flag joins them all
    (comma-separated too); any other takes the last one: a `choice:a|b` lower-cased, else
    through _PARSERS. ValueError saying what is expected."""
    if kind == "list":
        return [p.strip() for raw in raws for p in raw.split(",") if p.strip()]
    if not raws:
        return ""
    text = raws[-1].strip()
    if kind.startswith("choice:"):
        choices = kind[7:].split("|")
        return word_value(text, dict(zip(choices, choices)),
                          "expected one of " + ", ".join(choices))
    return _PARSERS[kind](text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help's layout: each flag with its metavar on a line, its help below, unwrapped."""

    def _format_action(self, action):
        metavar = " " + action.metavar if action.metavar else ""
        return "  %s%s\n      %s\n" % (", ".join(action.option_strings), metavar, action.help)


class FlagParser(argparse.ArgumentParser):
    """argparse for FLAGS, whose errors are ConfigErrors (one line, exit 2, from main)."""

    def error(self, message):
        raise ConfigError(message)


def flag_parser():
    """The argparse parser of FLAGS: each flag gives the list of raw values given for it (a
    bool flag alone gives "true"; None where a value is missing), and --help shows each
    flag's environment variable and default."""
    parser = FlagParser(
        usage="python3 boris.py [flags]", add_help=False, allow_abbrev=False,
        formatter_class=HelpFormatter,
        description="boris %s - an MCP server giving an AI agent a coding workspace\n(shell,"
        " view/edit/create files, grep/glob, workspace file tools, web fetch)." % __version__,
        epilog="""\
--allow-dir/--deny-dir scope the file tools. The shell is confined by --sandbox (Linux
Landlock; on by default with --allow-dir): commands may then write only under the allowed
directories and the temp directory (never to .git, .hg, .svn or boris.py: --sandbox-protect),
and use no network unless --sandbox-network on, or only the domains it lists (through a
loopback proxy). Deny patterns do not apply inside the shell; where Landlock is missing, use
a container.""")
    parser.color = False            # (Python 3.14+ would colour --help on a terminal)
    flags = parser.add_argument_group("flags (flag beats environment variable)")
    for flag, env, default, kind, text in FLAGS:
        metavar = "" if kind == "bool" else kind[7:] if kind.startswith("choice:") else \
            {"tristate": "auto|true|false", "chars": "N"}.get(kind, kind.upper())
        flags.add_argument("--" + flag, action="append", nargs="?", metavar=metavar,
                           const="true" if kind == "bool" else None, help="%s [env %s, default: %s]"
                           % (text, env, HELP_DEFAULTS.get(flag, default or "none")))
    flags.add_argument("--check", action="store_true",
                       help="print what this place gives a server of these flags, each part tried"
                       " (a write and a connect under the sandbox), and exit")
    flags.add_argument("--version", "-v", action="version", version="boris " + __version__,
                       help="print the version and exit")
    flags.add_argument("--help", action="help", help="print this help and exit")
    parser.add_argument("-h", action="help", help=argparse.SUPPRESS)
    return parser


LOCAL_HOSTS = frozenset(("localhost", "127.0.0.1", "::1", "[::1]"))


def host_of(value):
    """'host' of 'host:port', '[::1]:port' or a URL's netloc, lower-cased."""
    value = value.strip().lower()
    if "://" in value:
        value = value.split("://", 1)[1].split("/", 1)[0]
    if value.startswith("["):
        return value[:value.find("]") + 1]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback(host):
    """localhost, ::1 or an IPv4 address in 127.0.0.0/8 (not a name that starts with 127.)."""
    return (host in LOCAL_HOSTS
            or re.match(r"^127(\.(25[0-5]|2[0-4]\d|1?\d?\d)){3}$", host) is not None)


def host_allowed(host, allowed):
    """Whether `host` (a name; an IP address never) is one of the `allowed` domains: a name as
    given, or '*.example.org' for the names below example.org (not example.org itself)."""
    import fnmatch
    import ipaddress
    host = host.lower().rstrip(".").strip("[]")
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return False
    except ValueError:
        pass  # a name: matched below
    return any(host == a or a.startswith("*.") and fnmatch.fnmatchcase(host, a) for a in allowed)


def unknown_argument(arg):
    """The ConfigError for an argument no flag takes: a flag's near miss is named."""
    if not arg.startswith("--"):
        return ConfigError("unexpected argument %r (flags start with --; see --help)" % arg)
    import difflib
    name = arg[2:].partition("=")[0]
    near = difflib.get_close_matches(name, [row[0] for row in FLAGS], 1, 0.6)
    return ConfigError("unknown flag --%s (%ssee --help for the list)" % (
        name, "did you mean --%s? " % near[0] if near else ""))


def set_flag(config, row, environ):
    """Set one FLAGS row's typed value on config: the flag given, else its environment
    variable, else the default (ConfigError naming where a bad value came from)."""
    flag, env, default, kind, _ = row
    name = flag.replace("-", "_")
    given = getattr(config, name)
    if given and None in given:
        raise ConfigError("flag --%s needs a value" % flag)
    from_env = not given and environ.get(env)
    raws = given or ([environ[env]] if from_env else [default] if default else [])
    try:
        setattr(config, name, flag_value(kind, raws))
    except ValueError as e:
        raise ConfigError("invalid value %r for --%s: %s%s" % (
            raws[-1], flag, e, " (from environment variable %s)" % env if from_env else ""))


def parse_config(argv, environ):
    """Build a Config from argv and environ; raise ConfigError on any bad value.

    A flag's value is the last one given, else its environment variable, else the default;
    a list flag joins every value given (comma-separated too). `--help` and `--version`
    raise SystemExit(0) after printing (to stdout: the protocol has not started)."""
    config, unknown = flag_parser().parse_known_args(argv, Config())
    if unknown:
        raise unknown_argument(unknown[0])
    for row in FLAGS:
        set_flag(config, row, environ)
    if config.token_file:
        if config.token:
            raise ConfigError("--token and --token-file exclude each other: give one of them")
        config.token = token_from_file(config.token_file)
    if config.token and config.generate_token:
        raise ConfigError("--token and --generate-token exclude each other: give one of them")
    if config.transport == "http" and not (config.token or config.generate_token) \
            and not is_loopback(host_of(config.host)):
        raise ConfigError("--host %s is reachable from other machines, and without a token anyone"
                          " there could run commands: pass --token TOKEN or --generate-token, or"
                          " bind 127.0.0.1" % config.host)
    workdir = os.path.abspath(os.path.expanduser(config.workdir))
    if not os.path.isdir(workdir):
        raise ConfigError("--workdir %r is not a directory" % config.workdir)
    config.workdir = os.path.realpath(workdir)
    if not config.timeout:          # (a second default here would hide a mistyped flag)
        raise ConfigError("--timeout must be above 0 seconds: it is a command's time limit")
    network = config.sandbox_network
    if network in (["on"], ["off"], []):
        config.sandbox_network = {"on": True, "off": False}.get("".join(network))
    else:
        config.sandbox_network = sandbox_domains(network)
        config.web_fetch_allow = config.web_fetch_allow or list(config.sandbox_network)
    return config


def token_from_file(path):
    """The bearer token on the first line of --token-file
    `path` (ConfigError naming what is wrong)."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeError) as e:
        raise ConfigError("--token-file %r cannot be read: %s" % (path, getattr(e, "strerror", e)))
    if not token:
        raise ConfigError("--token-file %r holds no token on its first line" % path)
    return token


def sandbox_domains(network):
    """The domains of --sandbox-network, checked and lower-cased (ConfigError for anything else)."""
    for domain in network:
        if (domain in ("on", "off")
                or not re.match(r"^(\*\.)?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?$", domain)
                # (an IPv4 address; IPv6 has colons)
                or re.match(r"^[\d.]+$", domain)):
            raise ConfigError("invalid value %r for --sandbox-network: expected on, off, or domain"
                              " names (like pypi.org or *.example.org; no IP addresses, no ports)"
                              % domain)
    return [d.lower().rstrip(".") for d in network]

###############################################################################
# Paths #######################################################################
###############################################################################


POSIX_CLASSES = {"alpha": "a-zA-Z", "digit": "0-9", "alnum": "a-zA-Z0-9", "upper": "A-Z",
                 "lower": "a-z", "space": " \\t\\n\\r\\f\\v", "blank": " \\t",
                 "xdigit": "0-9A-Fa-f", "word": "\\w",
                 "punct": re.escape("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
                 "cntrl": "\\x00-\\x1f\\x7f", "print": "\\x20-\\x7e", "graph": "\\x21-\\x7e"}


def glob_class(pattern, i):
    """(regex, index after it) of the bracket expression starting at pattern[i]: ranges,
    '!'/'^' negation, POSIX classes such as [:digit:] (ValueError for an unknown name),
    backslash escapes; a `-` between two items is a range."""
    n, j = len(pattern), i + 1
    neg = j < n and pattern[j] in "!^"
    j += neg
    items = []
    while True:
        if j >= n:
            raise ValueError("unclosed '[' at position %d" % i)
        c, following = pattern[j], pattern[j + 1:j + 2]
        if c == "]" and items:
            break
        if pattern.startswith("[:", j):
            k = pattern.find(":]", j + 2)
            name = pattern[j + 2:k] if k > 0 else ""
            if name not in POSIX_CLASSES:
                raise ValueError("unknown character class [:%s:] at position %d (known: %s)"
                                 % (name, j, ", ".join(sorted(POSIX_CLASSES))))
            items.append(POSIX_CLASSES[name])
            j = k + 2
        elif c == "\\" and following:
            items.append(re.escape(following))
            j += 2
        else:
            items.append("-" if c == "-" and items and following not in ("]", "") else re.escape(c))
            j += 1
    return ("[^/%s]" if neg else "[%s]") % "".join(items), j + 1


def glob_star(pattern, i, git):
    """(regex, index after it) of the `*` or `**` at pattern[i]."""
    if not pattern.startswith("**", i):
        return "[^/]*", i + 1
    at_start = i == 0 or pattern[i - 1] == "/"
    i += 2
    if at_start and pattern.startswith("/", i):
        return "(?:.*/)?", i + 1                   # '**/' : any number of directories
    if git and not (at_start and i == len(pattern)):
        return "[^/]*", i                          # git: 'a**b' is 'a*b'
    return ".*", i                                 # trailing '/**' : everything below


def compile_glob(pattern, git=False):
    """Translate a glob (`*`, `**`, `?`, `[a-z]`, `[!a]`, `[[:digit:]]`, `{a,b}`, `\\x`)
    to a regex matched against a whole '/'-separated path. Raise ValueError naming the
    flaw. git=True: gitignore's rules - no braces, and a `**` not bounded by '/' is `*`."""
    try:
        return re.compile(glob_source(pattern, git), re.DOTALL)
    except (re.error, RecursionError, OverflowError) as e:
        raise ValueError(str(e))


def glob_source(pattern, git=False):
    """compile_glob's regex, as source (ValueError for a flaw found before compiling)."""
    out, i, n, depth = [], 0, len(pattern), 0
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            rx, i = glob_star(pattern, i - 1, git)
        elif c == "[":
            rx, i = glob_class(pattern, i - 1)
        elif c == "{" and not git:                 # braces: an alternation (not in gitignore)
            if depth >= MAX_BRACE_DEPTH:
                raise ValueError("braces nested over %d deep" % MAX_BRACE_DEPTH)
            rx, depth = "(?:", depth + 1
        elif c in "}," and depth:
            rx, depth = (")", depth - 1) if c == "}" else ("|", depth)
        elif c == "\\":
            if i == n:
                raise ValueError("a '\\' at the end escapes nothing (write '\\\\' for a backslash)")
            rx, i = re.escape(pattern[i]), i + 1
        else:
            rx = "[^/]" if c == "?" else re.escape(c)
        out.append(rx)
    if depth:
        raise ValueError("unclosed '{' (every '{' needs a matching '}')")
    return "".join(out) + r"\Z"


def pattern_denies(real, globs, names):
    """Whether a deny pattern matches `real` or one of the directories above it (a glob
    the path from /, a bare name one component)."""
    parts = real.strip("/").split("/")
    for k in range(len(parts), 0, -1):
        sub = "/".join(parts[:k])
        if any(rx.match(sub) for rx in globs) or any(rx.match(parts[k - 1]) for rx in names):
            return True
    return False


def fold_name(path):
    """A path as a case-folding volume compares it: NFC, case folded."""
    import unicodedata
    return unicodedata.normalize("NFC", path).casefold()


def case_folds(path):
    """Whether the volume holding `path` (or its deepest existing ancestor) folds case:
    a name there with letters, case swapped, reaches the same inode. False where no
    name with letters is found on that volume, or the probe cannot be made."""
    while True:
        try:
            st = os.lstat(path)
            break
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return False
            path = parent
    while path != "/":
        parent, name = os.path.split(path)
        if name.swapcase() != name:
            try:
                other = os.lstat(os.path.join(parent, name.swapcase()))
            except OSError:
                return False                    # no such name: this volume tells cases apart
            return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)
        try:
            up = os.lstat(parent)
        except OSError:
            return False
        if up.st_dev != st.st_dev:
            return False                        # the volume's own names hold no letter
        path, st = parent, up
    return False


def child_prefix(path):
    """`path/` (just `/` for the root): what a child's name is appended to."""
    return path + "/" if path != "/" else "/"


def is_within(path, root):
    """Component-wise containment of canonical paths: /ws2 is not inside /ws."""
    return path == root or path.startswith(child_prefix(root))


def canonical(path):
    """The canonical form of the absolute `path`, resolved one component at a time.

    Each symlink met is read and its target resolved in its place, so '..' is only
    ever applied to a resolved directory (never folded over an unresolved link, as
    os.path.realpath does after a loop). Components that do not exist are kept as
    they are (a path about to be created). Raises OSError: ELOOP past MAX_SYMLINKS
    links (a loop or a long chain), ENOTDIR when a file is used as a directory, and
    whatever lstat/readlink raise (EACCES, ENAMETOOLONG)."""
    todo = path.split("/")
    todo.reverse()
    done, links = "", 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            done = done[:done.rfind("/")]
            continue
        here = done + "/" + part
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            done = here
            continue
        if stat.S_ISLNK(mode):
            links += 1                  # its target's parts go onto todo, from '/' when absolute
            if links > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, "too many levels of symbolic links", here)
            target = os.readlink(here)
            todo += reversed(target.split("/"))
            done = "" if target.startswith("/") else done
            continue
        if not stat.S_ISDIR(mode) and any(p not in ("", ".") for p in todo):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", here)
        done = here
    return done or "/"


# errno -> (code, message) of a path that cannot be resolved: {0} is the path as given,
# {1} where its lookup failed, {2} the system's words
RESOLVE_ERRORS = {
    errno.ELOOP: (ACCESS_DENIED, "{0} runs into a symlink loop (or a chain of over %d"
                  " links) at {1}; give a path without the loop" % MAX_SYMLINKS),
    errno.ENOTDIR: (INVALID_INPUT,
                    "{0} uses {1} as a directory, but it is a file; check the path"),
    errno.ENAMETOOLONG: (INVALID_INPUT,
                         "{0} has a name over the file system's limit (255 bytes a name)"),
    **dict.fromkeys((errno.EACCES, errno.EPERM),
                    (ACCESS_DENIED, "{0}: the operating system denies looking up {1}")),
}


def resolve_error(e, shown):
    """Why `shown` could not be resolved, as the ToolError a model can act on."""
    code, why = RESOLVE_ERRORS.get(e.errno, (IO_ERROR, "{0} cannot be resolved: {2}"))
    return ToolError(code, why.format(shown, e.filename or shown, e.strerror or e))


class PathPolicy:
    """Resolve first, check second, touch the disk third. Only lstat/readlink here.

    Paths are compared the way their volume compares names: on one that folds case
    (macOS's APFS and HFS+ by default; vfat, CIFS, casefolded ext4 directories) `.ENV`
    and `SECRETS/k` are `.env` and `secrets/k`, so allow and deny compare them folded
    (and NFC-normalised, as HFS+ decomposes names). Whether a volume folds is probed
    (case_folds), not guessed from the platform; `folds` forces the answer."""

    @classmethod
    def of(cls, config):
        """The policy of a Config's --allow-dir, --deny-dir
        and --workdir (main's, and the tests')."""
        return cls(config.allow_dir, config.deny_dir, config.workdir)

    def __init__(self, allow=(), deny=(), workdir="/", folds=None):
        self.workdir = os.path.realpath(workdir)
        self.allow = [os.path.realpath(os.path.join(self.workdir, os.path.expanduser(a)))
                      for a in allow]
        self.deny_dirs, self.deny_globs, self.deny_names = [], [], []
        for d in deny:
            if re.search(r"[*?[{]", d):
                rx = compile_glob(d[1:] if d.startswith("/") else d)
                (self.deny_globs if "/" in d else self.deny_names).append(rx)
            else:
                self.deny_dirs.append(
                    os.path.realpath(os.path.join(self.workdir, os.path.expanduser(d))))
        self.deny_raw = list(deny)
        # what decides its verdicts
        self.key = (self.workdir, tuple(self.allow), tuple(self.deny_raw), folds)
        self.restricted = bool(self.allow or self.deny_raw)
        self.folds = folds                  # None: probe each volume; True/False: as given
        self.fold_seen = {}                 # directory -> whether its volume folds case (bounded)
        self.folded = None                  # (allow, deny dirs, deny globs, deny names)
                                            # folded, made on first use

    @staticmethod
    def validate(path, name="path"):
        """A path argument as given: not empty, within MAX_PATH_CHARS; else INVALID_INPUT
        naming `name`. (A NUL or a lone surrogate never gets this far: the schema check
        refuses them in every string argument.)"""
        if not path:
            raise ToolError(INVALID_INPUT, "%s must be a non-empty string" % name)
        if len(path) > MAX_PATH_CHARS:
            raise ToolError(INVALID_INPUT, "%s is %d characters long; the limit is %d"
                            % (name, len(path), MAX_PATH_CHARS))

    def resolve(self, base, path, name="path"):
        """The canonical absolute form of `path`, relative paths taken from `base`."""
        self.validate(path, name)
        try:
            return canonical(os.path.join(base, os.path.expanduser(path)))
        except OSError as e:
            raise resolve_error(e, path)

    def denial(self, real):
        """Why `real` (canonical) is out of scope, or None when it is allowed."""
        allow, deny_dirs = self.allow, self.deny_dirs
        globs, names = self.deny_globs, self.deny_names
        shown = real
        if self.volume_folds(real):
            if self.folded is None:
                ignore_case = lambda rx: re.compile(rx.pattern, rx.flags | re.IGNORECASE)
                self.folded = (list(map(fold_name, allow)),
                               list(map(fold_name, deny_dirs)),
                               list(map(ignore_case, globs)), list(map(ignore_case, names)))
            (allow, deny_dirs, globs, names), real = self.folded, fold_name(real)
        if allow and not any(is_within(real, a) for a in allow):
            return "is outside the allowed directories (%s)" % ", ".join(self.allow)
        for k, d in enumerate(deny_dirs):
            if is_within(real, d):
                return "is inside the denied directory %s" % self.deny_dirs[k]
        if (globs or names) and pattern_denies(real, globs, names):
            return "matches a denied pattern (%s)%s" % (
                ", ".join(self.deny_raw), "" if shown == real else " (this volume ignores case)")
        return None

    def volume_folds(self, real):
        """Whether the volume holding `real` compares names ignoring case: probed once
        per directory seen (case_folds), or as given to the policy."""
        if self.folds is not None or not self.restricted:
            return bool(self.folds)
        parent = real.rsplit("/", 1)[0] or "/"
        seen = self.fold_seen.get(parent)
        if seen is None:
            if len(self.fold_seen) > 4096:
                self.fold_seen.clear()
            seen = self.fold_seen[parent] = case_folds(real)
        return seen

    def is_denied(self, real):
        """Whether `real` (canonical) is out of scope; False at once when nothing is restricted."""
        return self.restricted and self.denial(real) is not None

    def clears_below(self, real):
        """Whether everything below the canonical directory `real`, reached without a symlink,
        is in scope: `real` is, no denied directory lies at or below it (compared folded,
        whatever the volume: a mount below may fold) and there are no deny patterns, which
        judge each name. A walk then checks none of its entries one by one."""
        if not self.restricted:
            return True
        if self.deny_globs or self.deny_names:
            return False
        inside = fold_name(real)
        if any(is_within(inside, d) or is_within(d, inside)
               for d in map(fold_name, self.deny_dirs)):
            return False
        return any(is_within(real, a) for a in self.allow) or self.denial(real) is None

    def check(self, real, shown):
        """`real` when it is in scope, else ACCESS_DENIED
        naming the path as the model gave it (`shown`)."""
        reason = self.denial(real) if self.restricted else None
        if reason:
            raise ToolError(ACCESS_DENIED,
                            "%s %s; use a path inside the allowed scope" % (shown, reason))
        return real

    def confine(self, path):
        """The workspace tools' path check: resolve against the workspace root, then
        require the canonical path to stay inside it (and inside allow/deny). An escape
        is ACCESS_DENIED (detail "escape"), which those tools answer in their fixed
        string; a path that cannot be resolved at all (a loop) is an escape attempt too."""
        self.validate(path)
        try:
            real = canonical(os.path.join(self.workdir, path))
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise resolve_error(e, path)
            real = None
        if real is None or not is_within(real, self.workdir) or self.is_denied(real):
            log("warn", "path escape attempt refused", path=path, resolved=real, root=self.workdir)
            raise ToolError(ACCESS_DENIED,
                            "%s resolves outside the workspace root %s" % (path, self.workdir),
                            detail="escape")
        return real

###############################################################################
# Files #######################################################################
###############################################################################

LINE_READ_MAX = 1 << 20                    # a longer line is read in pieces, its head kept
CLEANED_DIRS_MAX = 4096
IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
    (b"\x00\x00\x01\x00", "image/x-icon"),
)


def sniff(head, path):
    """('image', mime) | ('binary', None) | ('text', None) from the first bytes. A file that
    claims an image type but whose header does not decode as one (a model API refuses an
    image it cannot decode, and some clients then fail every later turn) is binary, and
    so is one mostly of control bytes or bytes that are no UTF-8."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return ("image", "image/webp") if head[12:15] == b"VP8" else ("binary", None)
    for magic, mime in IMAGE_MAGIC:
        if head.startswith(magic):
            if mime == "image/bmp" and (len(head) < 26 or b"\x00" not in head[:64]):
                continue       # 'BM' alone is too weak: require a binary header after it
            return ("image", mime) if image_header_ok(head, mime) else ("binary", None)
    if path.lower().endswith(".svg"):
        return "image", "image/svg+xml"
    if b"\x00" in head:
        return "binary", None
    text = head.decode("utf-8", "replace")[:-1]          # (the last may be cut mid-character)
    # control characters other than \t \n \r \f \b and ESC, and undecodable bytes
    odd = len(re.findall("[\ufffd\x00-\x07\x0b\x0e-\x1a\x1c-\x1f\x7f]", text))
    return ("binary", None) if len(text) >= 16 and odd * 10 > len(text) else ("text", None)


def image_header_ok(head, mime):
    """Whether the first bytes of an image of type `mime` decode as its header: a PNG's
    IHDR chunk (its checksum right, its sides not 0), a JPEG's next marker, a GIF's screen."""
    if mime == "image/png":
        if len(head) < 33 or head[12:16] != b"IHDR" or struct.unpack(">I", head[8:12])[0] != 13:
            return False
        width, height = struct.unpack(">II", head[16:24])
        return (width > 0 and height > 0
                and struct.unpack(">I", head[29:33])[0] == crc32(head[12:29]))
    if mime == "image/jpeg":
        return len(head) > 3 and head[3] in range(0xC0, 0xFF)
    if mime == "image/gif":
        return len(head) >= 13 and struct.unpack("<HH", head[6:10]) != (0, 0)
    return True


def clip_line(text):
    """A line as the tools show it: trailing CR dropped, cut at VIEW_MAX_LINE_CHARS
    with the full length named."""
    if text.endswith("\r"):
        text = text[:-1]
    if len(text) > VIEW_MAX_LINE_CHARS:
        text = "%s... [truncated, %d chars total]" % (text[:VIEW_MAX_LINE_CHARS], len(text))
    return text


def display_line(raw, more_chars=0):
    """A raw line (bytes, newline included) as view shows it; `more_chars` counts the
    characters of a very long line that were read past and not kept."""
    text = raw.decode("utf-8", "replace").rstrip("\n")
    if more_chars:
        return "%s... [truncated, %d chars total]" % (text[:VIEW_MAX_LINE_CHARS],
                                                      len(text) + more_chars)
    return clip_line(text)


def number_lines(lines, first):
    """`cat -n` form: each line after its number (from `first`, six wide) and a tab."""
    return "\n".join("%6d\t%s" % (first + k, line) for k, line in enumerate(lines))


def crc32(data, value=0):
    """CRC-32, imported when first needed: binascii's, which has one of its own where
    Python was built without zlib."""
    import binascii
    return binascii.crc32(data, value)


NOT_FILE_CODECS = frozenset(("undefined", "punycode", "idna", "raw-unicode-escape",
                             "unicode-escape"))


def text_codec(name):
    """The canonical name of `name` when it is a text encoding a file or page can be
    decoded with, else None: unknown names, bytes-to-bytes codecs (base64, zlib,
    rot13) and label codecs that are not file encodings (idna, punycode, undefined)."""
    try:
        info = codecs.lookup(name)
    except (LookupError, ValueError, TypeError):
        return None  # not a codec name Python knows: the caller says which encodings work
    if not getattr(info, "_is_text_encoding", True) or info.name in NOT_FILE_CODECS:
        return None
    return info.name


class LineBuffer:
    """Bytes in, whole lines out, in time linear in what is fed: one bytearray,
    searched for newlines only past where the last search stopped, consumed from
    the front (which a bytearray does without copying the rest). A line longer than
    `limit` comes out as None once, and is skipped to its end."""

    def __init__(self, limit=None):
        self.buf = bytearray()
        self.scanned = 0
        self.limit = limit
        self.skipping = False

    def feed(self, data):
        """The lines (bytes, newline dropped) that `data` completes."""
        buf = self.buf
        buf += data
        lines, start = [], 0
        while True:
            i = buf.find(b"\n", max(start, self.scanned))
            if i < 0:
                break
            if self.skipping:
                self.skipping = False
            else:
                with memoryview(buf) as view:         # one copy of the line, not two
                    lines.append(bytes(view[start:i]))
            start = i + 1
        if start:
            del buf[:start]
        self.scanned = len(buf)
        if self.limit is not None and len(buf) > self.limit:
            if not self.skipping:
                lines.append(None)
            self.skipping = True
            del buf[:]
            self.scanned = 0
        return lines

    def rest(self):
        """What is left after the last newline (at the end of input)."""
        return b"" if self.skipping else bytes(self.buf)


class LineReader:
    """Lines of a binary file object with memory bounded whatever the file holds:
    a line over LINE_READ_MAX bytes keeps its head and counts the rest; at most
    `budget` bytes are read in all (FileTooLarge past it)."""

    def __init__(self, fh, budget, whole=False):
        self.fh, self.budget, self.used = fh, budget, 0
        self.crc = 0 if whole else None     # whole: digest it, to know a file read to its end
        self.at_end = False

    def _counted(self, data):
        """`data`, read: counted against the budget and digested."""
        self.used += len(data)
        if self.used > self.budget:
            raise FileTooLarge(self.used)
        if self.crc is not None:
            self.crc = crc32(data, self.crc)
        return data

    def _take(self, size):
        data = self._counted(self.fh.readline(size))
        self.at_end = not data
        return data

    def digest(self):
        """digest_of() the whole file when it was read to its end, else None."""
        if self.crc is None or not (self.at_end or self.fh.read(1) == b""):
            return None
        return "%d:%08x" % (self.used, self.crc)

    def __iter__(self):
        while True:
            raw = self._take(LINE_READ_MAX)
            if not raw:
                return
            more = 0
            while not raw.endswith(b"\n") and len(raw) >= LINE_READ_MAX:
                rest = self._take(LINE_READ_MAX)
                if not rest:
                    break
                more += len(rest.rstrip(b"\n").decode("utf-8", "replace"))
                if rest.endswith(b"\n"):
                    break
            yield raw, more

    def count_rest(self):
        """Count the lines left without holding them."""
        n, last = 0, b"\n"
        while True:
            block = self._counted(self.fh.read(1 << 20))
            if not block:
                self.at_end = True
                return n + (0 if last == b"\n" else 1)
            n += block.count(b"\n")
            last = block[-1:]


class FileTooLarge(Exception):
    """More bytes than the size limit came out of a file (one that grows, or /proc)."""


def io_error(e, shown):
    """An OSError as the ToolError a model can act on."""
    if e.errno == errno.ENOENT:
        return ToolError(PATH_NOT_FOUND,
                         "%s does not exist; check the path (view a directory to list it)" % shown)
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        # The path was resolved without links a moment ago: one was swapped in since.
        return ToolError(ACCESS_DENIED, "%s changed while it was being opened (a directory or file"
                         " on the way was replaced, e.g. by a symlink); nothing was read or written"
                         % shown,
                         detail="swapped")
    if e.errno in (errno.EACCES, errno.EPERM):
        return ToolError(ACCESS_DENIED, "%s: permission denied by the operating system" % shown)
    if e.errno == errno.EISDIR:
        return ToolError(INVALID_INPUT, "%s is a directory, not a file" % shown)
    if e.errno == errno.ENAMETOOLONG:
        return ToolError(INVALID_INPUT,
                         "%s has a name over the file system's limit (255 bytes a name)" % shown)
    if e.errno == errno.EAGAIN:
        return ToolError(IO_ERROR, "%s has no data ready (a file that blocks readers);"
                         " it is not read" % shown)
    return ToolError(IO_ERROR, "%s: %s" % (shown, e.strerror or e))


def kind_of(mode):
    """A file type as words, for errors about things that are not regular files."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def not_regular(shown, mode, doing):
    """INVALID_INPUT for a path that is a device, fifo,
    socket or directory where a file is needed."""
    return ToolError(INVALID_INPUT, "%s is %s, not a regular file; it is not %s"
                     % (shown, kind_of(mode), doing))


# -- opening what was checked ---------------------------------------------------
# A canonical path is opened one component at a time from '/', each directory with
# O_NOFOLLOW|O_DIRECTORY relative to the one before and the file with O_NOFOLLOW
# relative to its directory. A symlink swapped in anywhere after the check makes the
# open fail (ELOOP/ENOTDIR) instead of leading outside the scope. O_PATH (Linux) needs
# only search permission on the directories; elsewhere they are opened read-only.

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIR_STEP = (getattr(os, "O_PATH", 0) or os.O_RDONLY) | os.O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
O_FILE = O_NOFOLLOW | O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)


def open_dir(real, create=False, flags=O_DIR_STEP, made=None):
    """An fd of the directory `real` (canonical), reached without following any link.
    create=True makes missing directories, 0755 whatever the umask, and appends the
    path of each one it made to `made` (when given)."""
    fd = os.open("/", O_DIR_STEP)
    try:
        parts = [p for p in real.split("/") if p]
        for k, part in enumerate(parts):
            step = flags if k == len(parts) - 1 else O_DIR_STEP
            try:
                nfd = os.open(part, step, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if made is not None:
                        made.append("/" + "/".join(parts[:k + 1]))
                except FileExistsError:
                    pass                # made meanwhile by someone else: used as it is
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC,
                              dir_fd=fd)
                try:
                    os.fchmod(nfd, 0o755)
                except OSError:
                    pass                # not ours to change: it still works as a directory
            os.close(fd)
            fd = nfd
        if not parts and flags != O_DIR_STEP:
            os.close(fd)
            fd = os.open("/", flags)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_file(real, flags=os.O_RDONLY):
    """An fd of `real` (canonical) opened relative to its checked directory: never
    through a link, never blocking on a FIFO, never a controlling terminal."""
    directory, base = os.path.split(real)
    if not base:
        return os.open("/", flags | O_CLOEXEC)
    dfd = open_dir(directory)
    try:
        return os.open(base, flags | O_FILE, dir_fd=dfd)
    finally:
        os.close(dfd)


def read_plain(path, limit=-1):
    """At most `limit` bytes of the regular file at `path`, links followed as git follows
    them; OSError for anything else: a FIFO or a device put there is never waited on.
    The reader of the files git keeps beside a work tree (.git, commondir, index,
    attributes)."""
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | O_CLOEXEC), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return f.read(limit)


def open_checked(job):
    """A binary file object of the file a helper's job names (its 'path' and 'file': device,
    inode), opened as open_file opens its last step (no link followed, no FIFO waited on),
    then made sure it is still that very regular file, the one the server checked;
    ToolError when it is gone, unreadable or another file stands there now."""
    fd = None
    try:
        fd = os.open(job["path"], os.O_RDONLY | O_FILE)
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and [st.st_dev, st.st_ino] == list(job["file"]):
            return os.fdopen(fd, "rb")
    except OSError:
        pass                                        # gone or unreadable since: not read
    if fd is not None:
        os.close(fd)
    raise ToolError(IO_ERROR, "it changed while it was being read (removed, or another file"
                    " stands at its path now); try again")


def open_regular(real, shown, doing="read"):
    """(fd, stat) of an existing regular file; ToolError for anything else (the
    fd is closed then). A directory's is INVALID_INPUT with detail "directory", which
    view answers with a listing and the other tools word their own way."""
    try:
        fd = open_file(real)
    except OSError as e:
        raise io_error(e, shown)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        err = not_regular(shown, st.st_mode, doing)
        err.detail = "directory" if stat.S_ISDIR(st.st_mode) else None
        raise err
    return fd, st


def read_fd(fd, limit, shown):
    """All of a file as bytes, never more than limit + 1 read (FILE_TOO_LARGE then)."""
    chunks, size = [], 0
    while True:
        block = os.read(fd, min(1 << 20, limit + 1 - size))
        if not block:
            return b"".join(chunks)
        chunks.append(block)
        size += len(block)
        if size > limit:
            raise too_large(shown, size, limit, more=True)


def ready(waited, timeout=None, write=False):
    """Those of `waited` (descriptors, or objects with fileno()) that are readable (writable
    with write=True), or at their end, within `timeout` seconds (None: until one is). The one
    wait on descriptors: poll(2), which takes descriptors past 1,024 as select(2) does not."""
    poller, by_fd = select.poll(), {}
    for f in waited:
        fd = f if isinstance(f, int) else f.fileno()
        by_fd[fd] = f
        poller.register(fd, select.POLLOUT if write else select.POLLIN)
    return [by_fd[fd]
            for fd, _ in poller.poll(None if timeout is None else max(0.0, timeout) * 1000)]


def too_large(shown, size, limit, more=False):
    """FILE_TOO_LARGE naming the file, its size (or 'over' a size, when reading stopped there)
    and the limit."""
    return ToolError(FILE_TOO_LARGE, "%s is %s%s; the limit is %s (--max-file-size)"
                     % (shown, "over " if more else "", human_size(size), human_size(limit)),
                     detail=limit)


def read_regular(real, shown, limit):
    """(bytes, stat) of an existing regular file no larger than `limit`."""
    fd, st = open_regular(real, shown)
    try:
        if st.st_size > limit:
            raise too_large(shown, st.st_size, limit)
        return read_fd(fd, limit, shown), st
    except OSError as e:
        raise io_error(e, shown)
    finally:
        os.close(fd)


def list_entries(real):
    """[(name, is_dir, link target or None)] of the directory `real` (canonical), sorted
    by name, read through a checked fd. is_dir follows links; an entry that cannot be
    stat'ed counts as a file. The one directory lister of view, list_directory."""
    fd = open_dir(real, flags=os.O_RDONLY | os.O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
    try:
        out = []
        with os.scandir(fd) as it:
            for e in it:
                link = None
                try:
                    if e.is_symlink():
                        link = os.readlink(e.name, dir_fd=fd)
                    is_dir = e.is_dir()
                except OSError:
                    is_dir = False
                out.append((e.name, is_dir, link))
        return sorted(out)
    finally:
        os.close(fd)


class Seen:
    """What a file held when a session last saw it: its stat stamp (size, mtime,
    inode) and, when the whole file was read, a digest of its bytes."""
    __slots__ = ("stamp", "size", "digest")

    def __init__(self, st, digest=None):
        self.stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        self.size, self.digest = st.st_size, digest


def digest_of(data):
    """A content digest for change detection (with the size)."""
    return "%d:%08x" % (len(data), crc32(data))


def changed_since(seen, real, limit):
    """None when `real` still holds what `seen` recorded (a touch is no change), else a
    short summary of the change."""
    try:
        st = os.stat(real)
    except OSError:
        return "it was removed"  # gone: that is the change
    if (st.st_size, st.st_mtime_ns, st.st_ino) == seen.stamp:
        return None
    if seen.digest is not None and st.st_size <= limit:
        try:
            if digest_of(read_regular(real, real, limit)[0]) == seen.digest:
                return None
        except ToolError:
            pass                # it cannot be read now: that is a change too
    when = time.time() - st.st_mtime
    modified = ("%.0f s ago" % when if when < 600
                else time.strftime("%H:%M:%S", time.localtime(st.st_mtime)))
    return "%s bytes then, %s bytes now; modified %s" % (seen.size, st.st_size, modified)


# -- the one writer ---------------------------------------------------------------

class FileGuards:
    """What the one writer keeps between calls, one per server and shared by all its
    sessions: a lock per canonical path being edited (so the read-modify-writes of
    parallel edits of a file all land), and the directories already cleaned of the
    temp files a killed boris left (at most CLEANED_DIRS_MAX, then forgotten)."""

    def __init__(self):
        self.guard = threading.Lock()
        self.locks = {}                     # real path -> [its lock, how many hold or wait]
        self.cleaned = set()                # (directory, dev, inode)

    def lock(self, real):
        """A context manager holding `real`'s edit lock."""
        return EditLock(self, real)

    def first_visit(self, key):
        """Whether directory `key` is to be cleaned now (not yet in this run)."""
        with self.guard:
            if key in self.cleaned:
                return False
            if len(self.cleaned) >= CLEANED_DIRS_MAX:    # bounded: a directory may be cleaned twice
                self.cleaned.clear()
            self.cleaned.add(key)
            return True


class EditLock:
    """Holds one path's lock of a FileGuards; the entry goes when nobody wants it."""

    def __init__(self, guards, real):
        self.guards, self.real = guards, real

    def __enter__(self):
        with self.guards.guard:
            entry = self.guards.locks.setdefault(self.real, [threading.Lock(), 0])
            entry[1] += 1
        entry[0].acquire()
        self.entry = entry
        return self

    def __exit__(self, *exc):
        self.entry[0].release()
        with self.guards.guard:
            self.entry[1] -= 1
            if not self.entry[1]:
                del self.guards.locks[self.real]


def atomic_write(real, data, guards, new_mode=0o644):
    """The one writer: a temp file in the target's directory, fsync, rename over it.

    `real` is canonical: writing through a symlink updates its target and keeps the
    link. The directory is opened by open_dir (missing ones made 0755) and every
    step is relative to it, so a swapped path cannot redirect the write. Only regular
    files are replaced. An existing file keeps its mode and owner (chown first: it
    clears setuid/setgid); a new one gets `new_mode` whatever the umask. Where the
    directory refuses a new file or the rename (a writable file in a read-only
    directory, a single-file bind mount), the file is rewritten in place instead,
    which is not crash-atomic. Returns True when written atomically. `guards` (a
    FileGuards) remembers which directories were cleaned of leftover temp files."""
    directory, base = os.path.split(real)
    made = []
    try:
        dfd = open_dir(directory, create=True, made=made)
        try:
            try:
                st = os.stat(base, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise not_regular(real, st.st_mode, "replaced; nothing was written")
            clean_leftovers(dfd, directory, guards)
            try:
                replace_file(dfd, base, data, st, new_mode)
                atomic = True
            except OSError as e:
                if st is None or e.errno not in (errno.EACCES, errno.EPERM, errno.EBUSY,
                                                 errno.EXDEV, errno.EROFS):
                    raise
                rewrite_in_place(dfd, base, data, st)
                atomic = False
            sync_dir(dfd)
            return atomic
        finally:
            os.close(dfd)
    except BaseException:
        for path in reversed(made):                # nothing half-done: the directories made go too
            try:
                os.rmdir(path)
            except OSError:
                break  # not empty (someone else wrote in it) or gone: left as it is
        raise


def remove_file(real):
    """Unlink a checked regular file relative to its directory (never through a link)."""
    directory, base = os.path.split(real)
    dfd = open_dir(directory)
    try:
        os.unlink(base, dir_fd=dfd)
    finally:
        os.close(dfd)


def replace_file(dfd, base, data, st, new_mode):
    """Write `data` to a new temp file in directory dfd, give it the old file's owner and mode (or
    `new_mode`), fsync, and rename it over `base`; the temp file goes on any failure. The temp
    file is an unnamed O_TMPFILE where the file system has it, so a kill -9 leaves nothing,
    else (macOS) a named one created exclusively, which a kill leaves beside the file until
    a later run's first write into that directory (clean_leftovers) finds its writer dead."""
    fd = tmp = None
    if hasattr(os, "O_TMPFILE"):
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError:
            pass  # no O_TMPFILE on this filesystem: a named temp file below
    if fd is None:
        tmp = temp_name(base)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_FILE, 0o600, dir_fd=dfd)
    try:
        write_all(fd, data)
        if st is not None and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
            try:
                os.fchown(fd, st.st_uid, st.st_gid)
            except OSError:
                pass  # not permitted: the new file keeps our ownership
        os.fchmod(fd, stat.S_IMODE(st.st_mode) if st is not None else new_mode)
        os.fsync(fd)
        if tmp is None:
            tmp = temp_name(base)
            os.link("/proc/self/fd/%d" % fd, tmp,
                    src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=True)
        os.replace(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd)
        tmp = None
    finally:
        os.close(fd)
        if tmp is not None:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass  # already gone: nothing to clean


def rewrite_in_place(dfd, base, data, st):
    """Overwrite the checked file itself (same inode): the fallback when the directory
    refuses a rename. Not crash-atomic."""
    fd = os.open(base, os.O_WRONLY | O_FILE, dir_fd=dfd)
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
            raise OSError(errno.ELOOP, "the file changed while it was being written")
        os.ftruncate(fd, 0)
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd, data):
    """os.write until every byte of `data` is written."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def sync_dir(dfd):
    """fsync a directory, so a rename in it survives a
    crash; where that cannot be done it is skipped."""
    try:
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return  # no handle on the directory: the rename stands, only its durability is not forced
    try:
        os.fsync(fd)
    except OSError:
        pass  # a filesystem that cannot sync directories: nothing more can be done
    finally:
        os.close(fd)


# Temp files are named `.NAME.boris-PID-RUNRAND.tmp`: RUN is this process's token, so a
# leftover of a killed run (same PID again as PID 1 in a container) is told apart.
_RUN_TOKEN = os.urandom(4).hex()
_TEMP_NAME = r"^\..*\.boris-(\d+)-([0-9a-f]{8})[0-9a-f]{8}\.tmp\Z"     # re caches it once used


def temp_name(base):
    """A temp name for `base` within the 255-byte name limit (the base is cut by bytes)."""
    short = base.encode("utf-8", "surrogateescape")[:96].decode("utf-8", "ignore")
    return ".%s.boris-%d-%s%s.tmp" % (short, os.getpid(), _RUN_TOKEN, os.urandom(4).hex())


def clean_leftovers(dfd, directory, guards):
    """Remove temp files a killed boris left in this directory (once per directory
    per run): those of a process that is gone, or of an earlier run with our PID. One
    whose PID now names another live process stays until that one ends. A directory
    that cannot be listed is not cleaned (nothing lost)."""
    try:
        st = os.fstat(dfd)
        # the path too: inodes are reused
        if not guards.first_visit((directory, st.st_dev, st.st_ino)):
            return
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC, dir_fd=dfd)
        try:
            with os.scandir(fd) as it:
                names = [e.name for e in it if e.name.startswith(".") and e.name.endswith(".tmp")]
        finally:
            os.close(fd)
    except OSError:
        return  # an fd we cannot stat or list: skip cleaning, the write goes on
    for name in names:
        m = re.match(_TEMP_NAME, name, re.DOTALL)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            stale = m.group(2) != _RUN_TOKEN   # ours from an earlier run (same PID again)
        else:
            try:
                os.kill(pid, 0)
                stale = False
            except ProcessLookupError:
                stale = True   # no such process: its temp files are leftovers
            except OSError:
                stale = False  # alive, another user's (EPERM): its files are in use
        if stale:
            try:
                os.unlink(name, dir_fd=dfd)
            except OSError:
                pass  # someone else removed it, or may not: left for the next run


###############################################################################
# Child processes #############################################################
###############################################################################
# The rule: whatever process boris starts, it starts through spawn() (directly or through
# a runner built on it), which records its pid until its Popen has collected the exit
# status, so the orphan reaper never steals one. On Linux boris is a child subreaper:
# what a command leaves running (`cmd &`, setsid, double-forked daemons) is re-parented
# to boris instead of init, and is killed when its call ends (found by the BORIS_CALL
# marker every command's environment carries). As PID 1 or subreaper, orphans are
# reaped by a background thread; at exit every child left, orphan or not, is killed
# and reaped (reap_all).

REAP_INTERVAL_S = 0.5                      # orphans re-parented to boris are reaped this often
RUN_OUTPUT_BYTES = 1 << 20                 # run_program keeps the last this much of a stream


class Children:
    """This process's children, process-wide by nature (waitpid, the subreaper setting
    and re-parented orphans are the process's): the pids that Popen objects own, and
    whether orphans are reaped."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live = set()               # pids spawn() started and reaped() has not yet forgotten
        self.reaping = False            # the reaper thread runs (we are a subreaper, or PID 1)
        self.wanted = False             # main() wants it; a library user's process is left alone


# A module-level object that changes at run time (the module docstring lists them all):
# the children are the process's, whichever server or session started them.
_children = Children()


# In a variable's name, any case: the variable is a secret, kept from every child
SECRET_NAMES = ("KEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL")
# All a helper process (this file run again, with -E) needs of the server's environment:
# where programs, home and the temp directory are, the locale, and where a Python built
# with a shared library finds it
HELPER_ENV = ("PATH", "HOME", "TMPDIR", "TEMP", "TMP", "LANG", "TZ",
              "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH")


def child_environ(environ=None, keep=(), drop=(), only=None):
    """The one rule for what a child process's environment holds: `environ` (the
    server's) less boris's own variables (BORIS_*, the HTTP token among them) and those
    named like a secret, unless a pattern in `keep` names them; less what `drop` names;
    with `only`, just those names (and LC_*)."""
    import fnmatch
    environ = os.environ if environ is None else environ

    def wanted(name):
        if only is not None and name not in only and not name.startswith("LC_"):
            return False
        if any(fnmatch.fnmatchcase(name, p) for p in drop):
            return False
        if not (name.startswith("BORIS_") or any(word in name.upper() for word in SECRET_NAMES)):
            return True
        return any(fnmatch.fnmatchcase(name, p) for p in keep)
    return {k: v for k, v in environ.items() if wanted(k)}


def spawn(argv, **kwargs):
    """subprocess.Popen(argv, **kwargs), its pid recorded until reaped(). A child given
    no env= gets a helper's (child_environ's HELPER_ENV): no child is ever handed the
    server's whole environment. In the server (main), the first spawn makes this process
    a subreaper (start-up never loads ctypes)."""
    import subprocess
    if _children.wanted:
        start_reaper()
    kwargs.setdefault("env", child_environ(only=HELPER_ENV))
    with _children.lock:
        proc = subprocess.Popen(argv, **kwargs)
        _children.live.add(proc.pid)
    return proc


def reaped(proc):
    """Forget a Popen whose exit status has been collected."""
    with _children.lock:
        _children.live.discard(proc.pid)


PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4


def _libc():
    """(ctypes, the C library) for the few system calls the standard library lacks."""
    import ctypes
    return ctypes, ctypes.CDLL(None, use_errno=True)


def prctl(option, value):
    """prctl(2) through ctypes (Linux); False where it is not to be had."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        _, libc = _libc()
        return libc.prctl(option, int(value), 0, 0, 0) == 0
    except (OSError, AttributeError, ImportError):
        return False  # no libc prctl here: the caller says what it lacks


def set_subreaper():
    """Become a child subreaper (Linux); False where it is not to be had."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def child_pids():
    """Pids whose parent is this process (any of its threads)."""
    pids = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for tid in tasks:
        try:
            with open("/proc/self/task/%s/children" % tid) as f:
                pids.update(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue  # a thread that just ended: its children are counted elsewhere
    return pids


def orphans():
    """Children of ours that no Popen owns: re-parented orphans."""
    pids = child_pids()
    with _children.lock:
        return pids - _children.live


def reap_orphans():
    """waitpid each re-parented orphan that has exited, without blocking."""
    for pid in orphans():
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # reaped already (by its Popen)


def start_reaper():
    """Become a subreaper (Linux) and, as one or as PID 1, reap orphans every
    REAP_INTERVAL_S. Returns whether the reaper runs."""
    with _children.lock:                           # two first spawns at once start one reaper
        if _children.reaping:
            return True
        if not (set_subreaper() or os.getpid() == 1):
            return False
        _children.reaping = True

    def loop():
        while True:
            time.sleep(REAP_INTERVAL_S)
            if not _children.reaping:              # turned off (a test restoring its state)
                return
            try:
                reap_orphans()
            except Exception:
                log("error", "orphan reaper failed", error=_traceback())
    threading.Thread(target=loop, daemon=True, name="boris-reaper").start()
    return True


def kill_marked(marker):
    """SIGKILL what is left of a command: processes re-parented to us (or still
    anywhere) whose environment carries BORIS_CALL=marker. Only scans /proc when
    some orphan exists, so a clean command costs one read of our children."""
    if not _children.reaping or not orphans():
        return
    needle = ("BORIS_CALL=%s\0" % marker).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as f:
                if needle in f.read():
                    os.kill(int(name), signal.SIGKILL)
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read: nothing to kill
    reap_orphans()


def reap_all(grace=KILL_GRACE_S):
    """At exit, after the sessions and helpers are closed: SIGKILL every child still
    here and reap each, until none is left or `grace` seconds pass. A child's own
    children come to us (the subreaper) as it dies, so each round kills anew. What
    we left unreaped would be a zombie of a PID 1 that may never reap."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        for pid in child_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # gone meanwhile: reaped below
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.01)                   # a child killed but not yet dead
        except ChildProcessError:
            return


def signal_group(proc, sig):
    """Send `sig` to a command's process group; one that is gone (or not ours) is skipped."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # gone, or never started: nothing to signal


def stop_group(proc, grace=KILL_GRACE_S):
    """SIGTERM the process group, give the leader `grace` seconds, SIGKILL the group
    (stragglers included), reap the leader."""
    import subprocess
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass  # still alive after the grace: SIGKILL follows
    signal_group(proc, signal.SIGKILL)
    proc.wait()
    kill_leftovers(proc)


def kill_leftovers(proc):
    """After a command's leader is reaped: forget it, kill what it left behind."""
    reaped(proc)
    kill_marked(proc.boris_call)


def kill_group(proc):
    """Kill a helper (or a spare sandbox launcher) with every process it started, reap
    it and close its pipes."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass  # already gone
    proc.wait()
    reaped(proc)
    for f in filter(None, (proc.stdin, proc.stdout, proc.stderr)):
        try:
            f.close()
        except OSError:
            pass  # a pipe whose other end died: nothing lost


def run_program(argv, cwd, timeout, sandbox=None, cancelled=None):
    """The one way a tool runs a program to its end: spawned in its own process group with
    the helpers' environment (never the server's whole one), confined
    as commands are when `sandbox` is on (it may run project code: git's filters, a build),
    its output cut to its last RUN_OUTPUT_BYTES a stream, its group killed once it ends, at
    `timeout` or once `cancelled()` is true, and reaped. (exit code, stdout, stderr);
    (None, b"", b"") when it did not end in time or was cancelled."""
    import subprocess
    if sandbox and sandbox.on:
        argv, cwd = sandbox.launched(argv, cwd)
    proc = spawn(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not (cancelled and cancelled()):
            try:
                out, err = proc.communicate(timeout=REAP_INTERVAL_S)
                return proc.returncode, out[-RUN_OUTPUT_BYTES:], err[-RUN_OUTPUT_BYTES:]
            except subprocess.TimeoutExpired:
                pass                                # (what it said so far is lost with it)
        return None, b"", b""
    finally:
        kill_group(proc)


# -- memory and environment ----------------------------------------------------

M_ARENA_MAX = -8                        # mallopt(3)'s parameter number in glibc


def give_back_memory(main_thread, wait_s=10.0):
    """Once `main_thread` is done with the script (its parse tree freed), hand the C
    library's free pages back to the system: glibc's malloc_trim(0). Elsewhere (musl,
    macOS) nothing is to be had and nothing is done."""
    deadline = time.monotonic() + wait_s
    while main_thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    trim_memory()


def trim_memory():
    """Hand the C library's free pages back to the system (glibc's malloc_trim(0)), after
    start-up or a walk that made and dropped many objects; elsewhere nothing is done."""
    try:
        _, libc = _libc()
        libc.malloc_trim(0)
    except (OSError, AttributeError, ImportError):
        log("debug", "no malloc_trim here: memory freed stays with the allocator")


def limit_malloc_arenas(n):
    """At most `n` malloc arenas, asked before any thread starts: glibc gives each thread
    that allocates one of its own, whose pages stay resident, while Python's own allocator
    serves small objects, so the server's threads hardly contend for one."""
    try:
        _, libc = _libc()
        libc.mallopt(M_ARENA_MAX, n)
    except (OSError, AttributeError, ImportError):
        log("debug", "no mallopt here: each thread may keep a malloc arena")


def importable(name):
    """Whether module `name` can be imported (ctypes can raise OSError too)."""
    try:
        __import__(name)
        return True
    except (ImportError, OSError):
        return False


def missing_modules():
    """The optional modules boris uses that this Python
    was built without (looked for, not loaded)."""
    from importlib.util import find_spec
    return [name.lstrip("_") for name in ("_ssl", "_ctypes", "zlib") if not find_spec(name)]


def seal_memory():
    """Keep this process's environment and memory from its commands (Linux): not dumpable,
    its /proc/<pid>/environ and mem belong to root and a same-user ptrace is refused, so a
    command cannot read the variables command_environ leaves out from its parent. A child
    gets its own back at exec. Root's commands can read them still."""
    return prctl(PR_SET_DUMPABLE, 0)


def scrub_environ_block():
    """Zero, in this process's memory, the variables child_environ keeps from every child
    (BORIS_*, those named like a secret), where the kernel shows the environment a process
    started with (/proc/<pid>/environ; Linux): a child between fork and exec is a copy of
    this process and would show them. os.environ keeps its own copy. False where the block
    cannot be found."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # env_start, env_end (stat fields 50, 51)
        start, end = int(fields[47]), int(fields[48])
        ctypes, _ = _libc()
        block = ctypes.string_at(start, end - start)
    except (OSError, IndexError, ValueError, ImportError):
        return False  # no /proc (or an old kernel): nothing to scrub here
    at = 0
    for entry in block.split(b"\0"):
        name = entry.split(b"=", 1)[0].decode("utf-8", "replace")
        if entry and not child_environ({name: ""}):
            ctypes.memset(start + at, 0, len(entry))
        at += len(entry) + 1
    return True


# -- helper processes -------------------------------------------------------------
# Every search, and every wait_for match, runs in a search helper: this same file run
# as `python3 -E -S -X utf8 -m boris_XXXXXXXX --helper KIND PARENT_PID` from a private
# directory (0700, ours) that holds nothing but a link to this file and the cached
# bytecode: no site-packages, and neither the workspace nor any cwd is ever on a
# helper's import path, while it starts in ~25 ms. A helper reads JSON lines on stdin,
# answers in JSON lines on stdout, writes its tracebacks to the server's stderr, and
# dies with its parent however the parent dies (guard_helper).

HELPER_WATCH_S = 0.2                       # a helper checks this often that its parent lives


def guard_helper(parent):
    """Make this helper die with `parent`: PR_SET_PDEATHSIG (Linux: the kernel kills it
    even while it is deep in a regex), else a watchdog process (helper_watchdog); at
    once when the parent died before. No thread: a helper forks search workers."""
    killed_by_kernel = prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is None:
        return
    if os.getppid() != parent:
        os._exit(0)
    if not killed_by_kernel:
        helper_watchdog(parent)


def helper_watchdog(parent):
    """Where the kernel cannot kill a helper with its parent (macOS: no PR_SET_PDEATHSIG),
    a watchdog process does, within HELPER_WATCH_S: the helper's watch thread cannot run
    while a regex holds the helper's interpreter, a process of its own can. It holds
    none of the helper's descriptors and ends with the helper. kqueue's NOTE_EXIT
    tells it of the parent's death where there is one; elsewhere it asks kill(parent, 0)."""
    helper = os.getpid()
    if os.fork() != 0:
        return
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, 65536)
        queue = None
        if hasattr(select, "kqueue"):
            queue = select.kqueue()
            try:
                queue.control([select.kevent(parent, select.KQ_FILTER_PROC, select.KQ_EV_ADD,
                                             select.KQ_NOTE_EXIT)], 0)
            except ProcessLookupError:
                os.kill(helper, signal.SIGKILL)     # the parent died already
                return
        while os.getppid() == helper:
            if queue is not None:
                gone = bool(queue.control(None, 1, HELPER_WATCH_S))
            else:
                time.sleep(HELPER_WATCH_S)
                try:
                    os.kill(parent, 0)
                    gone = False
                except ProcessLookupError:
                    gone = True
                except OSError:
                    gone = False                # alive, ours or not to signal
            if gone and os.getppid() == helper:
                os.kill(helper, signal.SIGKILL)
                break
    finally:
        os._exit(0)


def temp_dir():
    """The real path of the temp directory, or None where there is none to write in (a
    read-only root): tempfile's last resort, the cwd, is never taken for one."""
    import tempfile
    try:
        found = os.path.realpath(tempfile.gettempdir())
    except OSError:
        return None
    usual = ([os.environ.get(k) for k in ("TMPDIR", "TEMP", "TMP")]
             + ["/tmp", "/var/tmp", "/usr/tmp"])
    if (found == os.path.realpath(os.getcwd())
            and found not in [os.path.realpath(u) for u in usual if u]):
        return None
    return found


def cache_dir():
    """$XDG_CACHE_HOME, else ~/.cache, as a real path; None where no home is known (HOME
    unset and no passwd entry: '~' would be a folder of the cwd)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.realpath(cache) if os.path.isabs(cache) else None


def pycache_prefix(avoid=()):
    """A private directory for the helpers' cached bytecode and the link they are run
    through, or None when none is safe: a directory of ours, open to no one else, and
    not beneath `avoid` (the roots a sandboxed command may write, where a planted .pyc
    would run unconfined). The temp directory first, then /var/tmp and ~/.cache."""
    for base in (temp_dir(), "/var/tmp", cache_dir()):
        if base is None:
            continue
        path = os.path.join(os.path.realpath(base), "boris-pycache-%d" % os.geteuid())
        if any(is_within(path, a) for a in avoid) or not private_ok(path):
            continue
        return path
    return None


def private_ok(path):
    """Whether `path` is a directory of ours that no one else may write (made 0700)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # there already: checked below like a new one
    except OSError:
        return False  # cannot make it: the caller falls back to -I
    try:
        st = os.lstat(path)
    except OSError:
        return False  # cannot be checked: not used
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def helper_link(private, real):
    """The module name under which `private` holds a symlink to `real` (this file),
    made atomically when missing or stale; None when it cannot be made."""
    name = "boris_%08x" % crc32(real.encode("utf-8", "surrogateescape"))
    link = os.path.join(private, name + ".py")
    try:
        if os.readlink(link) == real:
            return name
    except OSError:
        pass  # no such link (or not ours): made below
    tmp = "%s.%d-%s" % (link, os.getpid(), os.urandom(4).hex())
    try:
        os.symlink(real, tmp)
        os.replace(tmp, link)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already gone: nothing to clean
        return None
    return name


def helper_command(kind, avoid=()):
    """argv and cwd that run this file as a helper of `kind`, child of this process.
    Without a private directory it runs isolated (-I: no cwd, no script directory on
    the path) and compiles this file at every start."""
    real = os.path.realpath(THIS_FILE)
    parent = str(os.getpid())
    private = pycache_prefix(avoid)
    name = helper_link(private, real) if private else None
    if name:
        return ([sys.executable, "-E", "-S", "-X", "utf8", "-X", "pycache_prefix=" + private,
                 "-m", name, "--helper", kind, parent], private)
    return [sys.executable, "-I", "-S", "-X", "utf8", real, "--helper", kind, parent], "/"


###############################################################################
# Sandbox #####################################################################
###############################################################################
# --sandbox confines every process a bash call starts, with the kernel: Landlock
# (Linux 5.13+, unprivileged, inherited by every descendant and never lifted). A
# launcher - this file run as `--helper sandbox PARENT SPEC SHELL -c SCRIPT`, started
# like the search helpers - builds the ruleset from SPEC, restricts itself and execs
# the shell, so the confinement is in place before the command's first instruction.
# Only write-like rights are handled: reads and exec stay as they were; writes are
# allowed beneath the writable roots only. Network off: no TCP bind or connect
# (Landlock ABI 4+), else a fresh network namespace (unprivileged user namespace);
# and on every kernel a seccomp filter (net_filter_program) that leaves a command no socket
# but Unix stream sockets, which it can pair (socketpair) but never connect to
# anything: UDP, raw and netlink sockets, pathname and abstract Unix sockets of the
# host (docker.sock, ssh-agent, D-Bus), a datagram's address and io_uring are refused.
# Signals and abstract unix sockets are scoped to the command's own domain (ABI 6+).
# A domain list (--sandbox-network pypi.org,...) is the network off but for one door:
# TCP sockets may be made, and the supervisor connects them only to the loopback port
# of EgressProxy (below), which the command's HTTP(S)_PROXY names and which connects
# only to the listed domains; Landlock allows TCP connect to that port alone.
# Protected paths (.git, .hg, .svn, this file; --sandbox-protect) under a writable
# root, which Landlock cannot take out of a grant, are bind-mounted read-only in a
# mount namespace of the command's own (in a user namespace) before Landlock, which
# then forbids any change of mounts: a write there is EROFS, a rename or removal of
# the path itself EBUSY, a hard link into or out of it EXDEV.

LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LL_WRITE_FILE, LL_REMOVE_DIR, LL_REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
LL_MAKE_ALL = sum(1 << k for k in range(6, 13))     # char, dir, reg, sock, fifo, block, sym
LL_REFER, LL_TRUNCATE = 1 << 13, 1 << 14
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1 << 0, 1 << 1
LL_RULE_PATH, LL_RULE_NET_PORT = 1, 2
LL_SCOPE_ABSTRACT_UNIX, LL_SCOPE_SIGNAL = 1 << 0, 1 << 1
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS = 0x10000000, 0x40000000, 0x00020000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_SLAVE, MS_RELATIME = 1, 32, 4096, 16384, 1 << 19, 1 << 21
MS_LOCKED_FLAGS = 2 | 4 | 8 | 1024 | 2048  # nosuid, nodev, noexec, noatime,
                                           # nodiratime: kept on remount
SANDBOX_PROTECT = (".git", ".hg", ".svn")  # kept read-only at the top of
                                           # workspace roots and one level down
SANDBOX_PROTECT_SCAN = 256                 # subdirectories of a workspace root looked into for them
# The network seccomp filter's system call numbers: for the machine's own ABI (socket and
# socketpair are looked at, connect and an addressed or Fast Open send refused) and for the
# 32-bit ABI it also runs (everything socket-like refused). The audit arch tags the seccomp data.
SECCOMP_ABIS = {
    "x86_64": (0xC000003E, dict(socket=41, socketpair=53, connect=42, sendto=44, sendmsg=46,
                                sendmmsg=307, io_uring_setup=425, seccomp=317),
               # i386: socketcall, socket, ...
               0x40000003, (102, 359, 360, 362, 369, 370, 345)),
    "aarch64": (0xC00000B7, dict(socket=198, socketpair=199, connect=203, sendto=206, sendmsg=211,
                                 sendmmsg=269, io_uring_setup=425, seccomp=277),
                # arm: socket, socketpair, ...
                0x40000028, (281, 288, 283, 290, 296, 374)),
}
MSG_FASTOPEN = 0x20000000                  # a send that connects a TCP socket,
                                           # past connect(2) and Landlock
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438                 # the same number on every Linux ABI
SECCOMP_NOTIF_RECV, SECCOMP_NOTIF_SEND, SECCOMP_NOTIF_ID_VALID = 0xC0502100, 0xC0182101, 0x40082102
SANDBOX_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty",
                   "/dev/ptmx")
SANDBOX_DEVICE_DIRS = ("/dev/pts", "/dev/shm")
SANDBOX_EXIT = 126                         # the launcher could not confine:
                                           # the command does not run
PROBE_S = 10                               # probe_sandbox's launcher must have answered by then
O_PATH = getattr(os, "O_PATH", os.O_RDONLY)    # (Linux has it; the sandbox is Linux's)


def landlock_abi():
    """The kernel's Landlock ABI version, 0 where it has none (not Linux, too old,
    or Landlock not enabled among the LSMs)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        ctypes, libc = _libc()
        abi = libc.syscall(LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except (OSError, AttributeError, ImportError):
        return 0  # no Landlock syscall here: ABI 0, and the caller says so
    return max(0, abi)


def errno_error(what):
    """The OSError of the C call `what` that just failed through ctypes (its errno)."""
    import ctypes
    code = ctypes.get_errno()
    return OSError(code, "%s: %s" % (what, os.strerror(code)))


# -- the kernel's parts: seccomp, Landlock, the network supervisor, namespaces ----
def net_filter_program(machine, supervised=False, inet=False):
    """The classic BPF program of the network seccomp filter for `machine`
    (os.uname().machine), as the bytes of its sock_filter array; None for a machine it
    does not know. A socket may be a Unix stream or seqpacket socket only (so no datagram
    can carry an address); connect is refused (supervised: handed to NetSupervisor), and
    so are sendto with an address, any send with MSG_FASTOPEN (sendto, sendmsg, sendmmsg:
    it connects without connect(2), where neither the supervisor nor Landlock looks) and
    io_uring (which would bypass the filter); a foreign ABI gets no socket call at all, an
    unknown one is killed. inet: IPv4 TCP sockets may be made too (their connect is the
    supervisor's to decide; no other protocol of SOCK_STREAM, such as SCTP)."""
    if machine not in SECCOMP_ABIS:
        return None
    arch, nr, compat_arch, compat_calls = SECCOMP_ABIS[machine]
    ld, jeq, jge, ret, and_ = 0x20, 0x15, 0x35, 0x06, 0x54
    allow, kill, notify = 0x7FFF0000, 0x80000000, 0x7FC00000
    refuse, nosys = 0x00050000 | errno.EACCES, 0x00050000 | errno.ENOSYS
    # seccomp_data.args[k], low or high half
    arg = lambda k, high=0: 16 + 8 * k + 4 * high
    code = [(ld, 4), (jeq, arch, "native"), (jeq, compat_arch, "compat"), (ret, kill),
            ("compat",), (ld, 0)] + [(jeq, n, "refuse") for n in compat_calls] + [
        (jeq, 425, "nosys"), (ret, allow),
        ("native",), (ld, 0), (jge, 0x40000000, "kill"),            # x32 numbers on x86_64
        (jeq, nr["socket"], "socket"), (jeq, nr["socketpair"], "socket"),
        (jeq, nr["connect"], "connect"), (jeq, nr["sendto"], "sendto"),
        (jeq, nr["sendmsg"], "sendmsg"), (jeq, nr["sendmmsg"], "sendmmsg"),
        (jeq, nr["io_uring_setup"], "nosys"), (ret, allow),
        # AF_UNIX
        ("socket",), (ld, arg(0)), (jeq, 1, "unix")] + [(jeq, 2, "inet")] * inet + [(ret, refuse),
        ("unix",), (ld, arg(1)), (and_, 0xF), (jeq, 1, "allow"), (jeq, 5, "allow"), (ret, refuse),
        # AF_INET, SOCK_STREAM
        ("inet",), (ld, arg(1)), (and_, 0xF), (jeq, 1, "tcp"), (ret, refuse),
        ("tcp",), (ld, arg(2)), (jeq, 0, "allow"), (jeq, 6, "allow"), (ret, refuse),  # IPPROTO_TCP
        ("sendto",), (ld, arg(3)), (and_, MSG_FASTOPEN), (jeq, 0, "addressed"), (ret, refuse),
        # a destination address: refused
        ("addressed",), (ld, arg(4)), (jeq, 0, "low"), (ret, refuse),
        ("low",), (ld, arg(4, 1)), (jeq, 0, "allow"), (ret, refuse),
        ("sendmsg",), (ld, arg(2)), (and_, MSG_FASTOPEN), (jeq, 0, "allow"), (ret, refuse),
        ("sendmmsg",), (ld, arg(3)), (and_, MSG_FASTOPEN), (jeq, 0, "allow"), (ret, refuse),
        ("connect",), (ret, notify if supervised else refuse),
        ("allow",), (ret, allow), ("refuse",), (ret, refuse),
        ("nosys",), (ret, nosys), ("kill",), (ret, kill)]
    labels, ops = {}, []
    for op in code:
        if len(op) == 1:
            labels[op[0]] = len(ops)
        else:
            ops.append(op)
    # a jump goes to its label when equal (or >=), else on
    return b"".join(struct.pack("<HBBI", op[0], labels[op[2]] - at if len(op) == 3 else 0, 0,
                                op[1]) for at, op in enumerate(ops, 1))


def net_filter_available():
    """Whether this kernel and machine take the network seccomp filter: seccomp filters are
    built in (a probe with no program answers EFAULT, not EINVAL) and the machine's system
    call numbers are known."""
    if not sys.platform.startswith("linux") or net_filter_program(os.uname().machine) is None:
        return False
    try:
        ctypes, libc = _libc()
        r = libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.c_void_p(0),
                       0, 0)
    except (OSError, AttributeError, ImportError):
        return False  # no prctl here: no seccomp
    return r < 0 and ctypes.get_errno() in (errno.EFAULT, errno.EACCES)


def net_fprog(supervised, inet=False):
    """(struct sock_fprog, the program it points to) of the network seccomp filter
    (net_filter_program), as ctypes buffers."""
    ctypes, _ = _libc()
    program = net_filter_program(os.uname().machine, supervised, inet)
    if program is None:
        raise OSError(errno.ENOSYS, "no seccomp system call table for %s" % os.uname().machine)
    buf = ctypes.create_string_buffer(program, len(program))
    return ctypes.create_string_buffer(struct.pack("@HP", len(program) // 8,
                                                   ctypes.addressof(buf))), buf


def apply_net_filter(supervised=False, fprog=None):
    """Install the network seccomp filter on this process, no_new_privs set first: inherited
    by all it starts, never lifted. supervised: connect calls go to a listener, whose
    descriptor is returned (else None). `fprog`: the program as net_fprog made it ahead of
    time (a launcher makes it before it forks)."""
    ctypes, libc = _libc()
    fprog = fprog or net_fprog(supervised)
    # set again where Landlock.restrict set it (a no-op); where it failed, seccomp's EACCES says so
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if supervised:                              # seccomp(SET_MODE_FILTER, FLAG_NEW_LISTENER, prog)
        fd = libc.syscall(SECCOMP_ABIS[os.uname().machine][1]["seccomp"], 1, 8, fprog[0])
        if fd < 0:
            raise errno_error("seccomp listener")
        return fd
    if libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), fprog[0], 0, 0) != 0:
        raise errno_error("seccomp filter")
    return None


class Landlock:
    """A Landlock ruleset built from a launcher's spec: write rights handled (and TCP
    when spec['net'] is 'landlock'; signals and abstract Unix sockets scoped to the
    domain from ABI 6), granted beneath spec['writable'] and the harmless devices (a
    path this system lacks is skipped). restrict() confines this process and all it
    will start; called again, it enters a nested domain of the same rules."""

    def __init__(self, spec):
        ctypes, libc = self.ctypes, self.libc = _libc()
        abi = spec["abi"]
        write = LL_WRITE_FILE | LL_REMOVE_DIR | LL_REMOVE_FILE | LL_MAKE_ALL
        write |= (LL_REFER if abi >= 2 else 0) | (LL_TRUNCATE if abi >= 3 else 0)
        net = LL_NET_BIND_TCP | LL_NET_CONNECT_TCP if spec["net"] == "landlock" else 0
        scoped = LL_SCOPE_SIGNAL | (LL_SCOPE_ABSTRACT_UNIX if spec["net"] else 0) if abi >= 6 else 0
        attr = struct.pack("<QQQ", write, net, scoped)[:8 if abi < 4 else 16 if abi < 6 else 24]
        buf = ctypes.create_string_buffer(attr, len(attr))
        self.fd = libc.syscall(LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)),
                               ctypes.c_uint32(0))
        if self.fd < 0:
            raise errno_error("landlock_create_ruleset")
        try:
            file_rights = write & (LL_WRITE_FILE | LL_TRUNCATE)     # (truncate: from ABI 3)
            for path, rights in ([(p, write)
                                  for p in spec["writable"] + list(SANDBOX_DEVICE_DIRS)]
                                 + [(p, file_rights) for p in SANDBOX_DEVICES]):
                try:
                    fd = os.open(path, O_PATH | O_CLOEXEC)
                except OSError:
                    continue                    # (a device or directory this system lacks)
                try:
                    self.add(LL_RULE_PATH, struct.pack("<Qi", rights, fd), path)
                finally:
                    os.close(fd)
            # the proxy's port, the one TCP connect allowed
            if net and spec.get("proxy"):
                self.add(LL_RULE_NET_PORT, struct.pack("<QQ", LL_NET_CONNECT_TCP, spec["proxy"]),
                         "port")
        except BaseException:
            os.close(self.fd)
            raise

    def add(self, kind, attr, what):
        """Add one rule of `kind` (its packed attribute); OSError naming `what` when refused."""
        ctypes, libc = self.ctypes, self.libc
        rule = ctypes.create_string_buffer(attr, len(attr))
        if libc.syscall(LANDLOCK_ADD_RULE, self.fd, kind, rule, ctypes.c_uint32(0)) < 0:
            raise errno_error("landlock_add_rule " + what)

    def restrict(self):
        """Enter a (further) Landlock domain of the rules, no_new_privs set first."""
        ctypes, libc = self.ctypes, self.libc
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(LANDLOCK_RESTRICT_SELF, self.fd, ctypes.c_uint32(0)) < 0:
            raise errno_error("landlock_restrict_self")

    def close(self):
        """Close the ruleset (the domains entered stay)."""
        os.close(self.fd)


class NetSupervisor:
    """The process that serves a sandboxed command's connect calls (confine() makes
    it): `child` is the command, `listener` the seccomp listener its filter notifies."""

    def __init__(self, child, listener, proxy=None):
        self.child, self.listener, self.proxy = child, listener, proxy
        self.ctypes, self.libc = _libc()

    @classmethod
    def confine(cls, spec, landlock):
        """Cut the network of this launcher's command with the network seccomp filter.
        Where abstract Unix sockets are the sandbox's own (Landlock ABI 6 scopes them; a
        network namespace has its own), the launcher forks: the child, confined once more
        by Landlock (so it cannot signal its parent), installs the filter with a listener
        and becomes the command; this process stays as its supervisor (serve), which lets
        the command connect to abstract sockets of its own (Python's multiprocessing
        forkserver uses one) and refuses every other connect. Elsewhere connect is refused
        outright."""
        import socket
        if not (spec["abi"] >= 6 or spec["net"] == "netns"):
            apply_net_filter()
            return
        # made before the fork: the child only installs it
        fprog = net_fprog(True, bool(spec.get("proxy")))
        ours, theirs = socket.socketpair()
        # a collection would copy the heap page by page (COW)
        gc.disable()
        pid = os.fork()
        if pid == 0:
            ours.close()
            # nested: the command may not signal its supervisor
            landlock.restrict()
            listener = apply_net_filter(True, fprog)
            theirs.sendmsg([b"L"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                     struct.pack("i", listener))])
            os.close(listener)
            theirs.close()
            return
        theirs.close()
        try:
            _, ancillary, _, _ = ours.recvmsg(1, socket.CMSG_SPACE(4))
            listener = struct.unpack("i", ancillary[0][2][:4])[0]
        except (OSError, IndexError):
            # the child failed to confine: it reports and exits
            listener = None
        ours.close()
        cls(pid, listener, spec.get("proxy")).serve()

    def serve(self):
        """Serve the command's connect calls until the command (`child`) ends, then end
        the same way it did. An abstract address (a leading NUL) is connected here, on
        the command's own socket (pidfd_getfd) with the address as read once, so the
        command cannot change it after the check; anything else is refused (EACCES).
        Signals a terminal or boris sends the group are left to the command. Once this
        process ends, a connect still attempted by a leftover descendant fails (ENOSYS)."""
        ctypes, libc, child, listener = self.ctypes, self.libc, self.child, self.listener
        for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP, signal.SIGTSTP):
            signal.signal(sig, signal.SIG_IGN)
        child_fd = libc.syscall(SYS_PIDFD_OPEN, child, 0)
        poller = select.poll()
        for fd in (child_fd, listener):
            if fd is not None and fd >= 0:
                poller.register(fd, select.POLLIN)
        notif = ctypes.create_string_buffer(80)
        while True:
            _, status = os.waitpid(child, os.WNOHANG)
            if _:
                break
            try:
                ready = dict(poller.poll(1000 if child_fd >= 0 else 50))
            except InterruptedError:
                continue
            if listener is not None and ready.get(listener, 0) & (select.POLLHUP | select.POLLERR):
                # no filtered process is left: only the wait remains
                poller.unregister(listener)
                listener = None
            if listener is None or not ready.get(listener, 0) & select.POLLIN:
                continue
            ctypes.memset(notif, 0, 80)
            if libc.ioctl(listener, ctypes.c_ulong(SECCOMP_NOTIF_RECV), notif) != 0:
                continue                            # the caller died meanwhile
            nid, pid = struct.unpack_from("<QI", notif.raw)
            # connect(fd, addr, addrlen)
            fd, addr, size = struct.unpack_from("<QQQ", notif.raw, 32)
            error = self.connect(nid, pid, fd, addr, size)
            libc.ioctl(listener, ctypes.c_ulong(SECCOMP_NOTIF_SEND),
                       ctypes.create_string_buffer(struct.pack("<QqiI", nid, 0, -error, 0), 24))
        if os.WIFSIGNALED(status):
            if os.WTERMSIG(status) != signal.SIGKILL:
                signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
            os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)

    def connect(self, nid, pid, fd, addr, size):
        """The answer to one connect: 0 once done, else the errno. The
        address is read once from the caller's memory and everything after uses that
        copy: an abstract address is connected as it is (Landlock or the namespace keeps
        foreign ones out), and so is the proxy's (127.0.0.1 at its port, with a domain
        list; any other IP address is refused); a path is opened (O_PATH, from the
        caller's cwd) and connected through that descriptor, so the socket checked is the
        socket reached, and only
        when a process of the command (its session) is listening on it."""
        ctypes, libc = self.ctypes, self.libc
        if not 3 <= size <= 110:
            return errno.EACCES
        try:
            with open("/proc/%d/mem" % pid, "rb", buffering=0) as mem:
                mem.seek(addr)
                sockaddr = mem.read(size)
        except (OSError, OverflowError, ValueError):
            return errno.EACCES                     # unreadable: refused
        family = struct.unpack_from("<H", sockaddr)[0] if len(sockaddr) == size else None
        proxy = (family == 2 and self.proxy and size >= 8
                 and sockaddr[2:8] == struct.pack(">H", self.proxy) + b"\x7f\0\0\1")
        if family != 1 and not proxy:
            return errno.EACCES                     # not a Unix address, nor the proxy's
        if libc.ioctl(self.listener, ctypes.c_ulong(SECCOMP_NOTIF_ID_VALID),
                      ctypes.byref(ctypes.c_uint64(nid))) != 0:
            # the caller is gone: the pid may be another process now
            return errno.EACCES
        checked = None
        if proxy:
            sockaddr = sockaddr[:8] + b"\0" * 8    # 127.0.0.1:the proxy's port, as a sockaddr_in
        elif sockaddr[2:3] != b"\0":
            checked = self.socket_file(pid, sockaddr[2:].split(b"\0", 1)[0])
            if checked is None:
                return errno.EACCES                 # a socket of the host (or none): refused
            sockaddr = struct.pack("<H", 1) + b"/proc/self/fd/%d\0" % checked
        try:
            return self.connect_theirs(pid, fd, sockaddr)
        finally:
            if checked is not None:
                os.close(checked)

    def connect_theirs(self, pid, fd, sockaddr):
        """Connect the socket `fd` of process `pid` (a copy of it, taken with pidfd_getfd) to
        `sockaddr`: 0 once done, else the errno."""
        ctypes, libc = self.ctypes, self.libc
        pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
        if pidfd < 0:
            return ctypes.get_errno() or errno.EBADF
        try:
            theirs = libc.syscall(SYS_PIDFD_GETFD, pidfd, ctypes.c_int(fd), 0)
            if theirs < 0:
                return ctypes.get_errno() or errno.EBADF
            try:
                buf = ctypes.create_string_buffer(sockaddr, len(sockaddr))
                return 0 if libc.connect(theirs, buf, len(sockaddr)) == 0 else ctypes.get_errno()
            finally:
                os.close(theirs)
        finally:
            os.close(pidfd)

    @staticmethod
    def socket_file(pid, path):
        """An O_PATH descriptor of the socket file `path` (resolved from process pid's
        cwd) when a process of this command (this session) listens on it, else None.
        Listening sockets come from /proc/net/unix (path and socket inode); a socket's
        holders from /proc/PID/fd of the session's processes."""
        try:
            cwd = os.open("/proc/%d/cwd" % pid, O_PATH | os.O_DIRECTORY)
        except OSError:
            return None                             # the caller is gone: refused
        try:
            fd = os.open(path, O_PATH | O_CLOEXEC, dir_fd=cwd)
        except OSError:
            return None
        finally:
            os.close(cwd)
        st = os.fstat(fd)
        if stat.S_ISSOCK(st.st_mode):
            inodes = set()
            with open("/proc/net/unix", "rb") as f:
                for line in f.read().splitlines()[1:]:
                    fields = line.split(None, 7)
                    if len(fields) == 8 and fields[7].startswith(b"/"):
                        try:
                            same = os.stat(fields[7])
                        except OSError:
                            continue                # gone, or not reachable from here
                        if (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino):
                            inodes.add(b"socket:[%s]" % fields[6])
            sid = os.getsid(0)
            for name in [n for n in os.listdir("/proc") if n.isdigit()] if inodes else ():
                try:          # a process of this session holding a descriptor of that socket?
                    with open("/proc/%s/stat" % name, "rb") as f:
                        if int(f.read().rsplit(b")", 1)[1].split()[3]) != sid:
                            continue
                    fds = os.listdir("/proc/%s/fd" % name)
                except (OSError, ValueError, IndexError):
                    continue                        # gone, or not ours to look at
                for link in fds:
                    try:
                        if os.fsencode(os.readlink("/proc/%s/fd/%s" % (name, link))) in inodes:
                            return fd
                    except OSError:
                        continue                    # closed meanwhile
        os.close(fd)
        return None


def enter_namespaces(net, protect):
    """unshare a user namespace, with a network namespace (no interface but a down
    loopback) when `net`, and a mount namespace where the `protect` paths are bind-mounted
    read-only. Users keep their ids: an ordinary user is mapped to itself; root to every
    id its own namespace has (a child still outside writes the map: a rootless
    container's root maps its range), so root may still write files of other owners."""
    ctypes, libc = _libc()
    uid, gid = os.geteuid(), os.getegid()
    mapper, ready = fork_id_mapper() if uid == 0 else (None, None)
    flags = CLONE_NEWUSER | (CLONE_NEWNET if net else 0) | (CLONE_NEWNS if protect else 0)
    failed = libc.unshare(flags) != 0 and ctypes.get_errno()
    if mapper is not None:
        os.write(ready, b"u" if not failed else b"x")
        os.close(ready)
        _, status = os.waitpid(mapper, 0)
        if not failed and status != 0:
            raise OSError(errno.EPERM, "the user namespace's id map could not be written")
    if failed:
        raise OSError(failed, "unshare(CLONE_NEWUSER%s%s): %s"
                      % ("|CLONE_NEWNET" if net else "", "|CLONE_NEWNS" if protect else "",
                         os.strerror(failed)))
    if mapper is None:
        # A non-dumpable process's /proc/self files are root's: dumpable for the map
        # writes alone (as runc does), sealed again before anything runs.
        prctl(PR_SET_DUMPABLE, 1)
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)),
                               ("gid_map", "%d %d 1" % (gid, gid))):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
        finally:
            seal_memory()
    if protect:
        mount_read_only(protect)


def fork_id_mapper():
    """For root: (the pid of a child left outside the namespace about to be made, which
    alone may map every id into it, the pipe to tell it b"u" once the namespace is there).
    The child maps every id this namespace has as itself, and exits 0 when it did."""
    go, ready = os.pipe()
    mapper = os.fork()
    if mapper == 0:
        os.close(ready)
        ok = os.read(go, 1) == b"u"
        try:
            for name in ("uid_map", "gid_map"):
                with open("/proc/self/" + name) as f:
                    ids = "".join("%s %s %s\n" % (l.split()[0], l.split()[0], l.split()[2])
                                  for l in f if l.strip())
                with open("/proc/%d/%s" % (os.getppid(), name), "w") as f:
                    f.write(ids)
        except (OSError, IndexError):
            ok = False
        os._exit(0 if ok else 1)
    os.close(go)
    return mapper, ready


def mount_read_only(paths):
    """In this process's new mount namespace (its mounts no longer shared back): bind-mount
    each of `paths` on itself read-only, keeping the flags a user namespace may not drop."""
    ctypes, libc = _libc()
    mount = lambda source, target, flags: libc.mount(source, os.fsencode(target), None,
                                                     ctypes.c_ulong(flags), None)
    if mount(None, "/", MS_REC | MS_SLAVE) != 0:
        raise errno_error("mount(/, MS_REC|MS_SLAVE)")
    for path in paths:
        kept = os.statvfs(path).f_flag
        flags = (MS_REMOUNT | MS_BIND | MS_RDONLY | (kept & MS_LOCKED_FLAGS)
                 | (MS_RELATIME if kept & 4096 else 0))
        if mount(os.fsencode(path), path, MS_BIND) != 0 or mount(None, path, flags) != 0:
            raise errno_error("a read-only mount of " + path)


# -- the sandbox and its launchers ------------------------------------------------
class Protect:
    """What stays read-only for sandboxed commands under their writable roots: `names`
    looked for at the top of each workspace root (`roots`) and of its subdirectories,
    absolute `files`; a .git file's gitdir (and that one's common directory) too.
    `enforced` is False where no user namespace can be made (describe says so)."""

    def __init__(self, roots=(), names=(), files=(), enforced=True):
        self.roots, self.names, self.files = list(roots), list(names), list(files)
        self.enforced = enforced
        self.why = ""                                   # why not enforced: what the probe met

    @classmethod
    def of(cls, config, policy):
        """The Protect that --sandbox-protect asks for: the defaults (SANDBOX_PROTECT and
        this file) unless 'none' is among the values, and the names and paths given."""
        given = [v for v in config.sandbox_protect if v]
        names = [] if "none" in given else list(SANDBOX_PROTECT)
        files = [] if "none" in given or not THIS_FILE else [os.path.realpath(THIS_FILE)]
        for value in given:
            if value == "none":
                continue
            if "/" not in value.rstrip("/"):
                names.append(value.rstrip("/"))
            elif os.path.isabs(os.path.expanduser(value)):
                files.append(os.path.realpath(os.path.expanduser(value)))
            else:
                raise ConfigError("--sandbox-protect %r is neither a name (like .git) nor an"
                                  " absolute path" % value)
        return cls(list(policy.allow) or [policy.workdir], names, files)

    def wanted(self):
        """Whether commands are to have protected paths (each needs a user namespace)."""
        return self.enforced and bool(self.names or self.files)

    def paths(self, writable):
        """The existing protected paths beneath the `writable` roots (others are read-only
        already), real paths, sorted; [] when not enforced."""
        if not self.enforced:
            return []
        found = set(self.files)
        for root in self.roots:
            tops = [root]
            try:
                with os.scandir(root) as it:
                    for entry in it:
                        if entry.is_dir(follow_symlinks=False) and entry.name not in self.names:
                            tops.append(entry.path)
                            if len(tops) > SANDBOX_PROTECT_SCAN:
                                break
            except OSError:
                pass  # an unreadable root: only its top is looked at
            for top in tops:
                for name in self.names:
                    path = os.path.join(top, name)
                    if not os.path.lexists(path):
                        continue
                    found.add(os.path.realpath(path))
                    if name == ".git" and os.path.isfile(path):
                        found.update(self.git_dirs(path))
        return sorted(p for p in found
                      if os.path.lexists(p) and any(is_within(p, w) for w in writable))

    @staticmethod
    def git_dirs(path):
        """The directory a .git file names (gitdir: ...),
        and its common directory (a worktree's)."""
        try:
            line = read_plain(path, 4096).split(b"\n", 1)[0].decode("utf-8", "surrogateescape")
        except OSError:
            return []
        if not line.startswith("gitdir:"):
            return []
        gitdir = os.path.realpath(os.path.join(os.path.dirname(path), line[7:].strip()))
        dirs = [gitdir]
        try:
            common = read_plain(os.path.join(gitdir, "commondir"), 4096).strip()
            dirs.append(os.path.realpath(os.path.join(gitdir, os.fsdecode(common))))
        except OSError:
            pass  # not a worktree: no common directory
        return dirs

    def describe(self):
        """The protection in a few words, for the sandbox's line."""
        if not self.enforced:
            return "protected paths NOT enforced (no user namespaces here: .git stays writable)"
        shown = self.names + [os.path.basename(f) for f in self.files]
        return "read-only inside them: %s" % (", ".join(shown) if shown
                                              else "nothing (--sandbox-protect none)")


class Launchers:
    """Sandbox launchers started ahead, so that a sandboxed command need not wait for
    Python to start and load this file: one waits, loaded, on a pipe; a command takes
    it and a new one starts behind it. Owned by the server's Sandbox; close() ends the
    spare."""

    def __init__(self, sandbox):
        self.sandbox = sandbox
        self.lock = threading.Lock()
        self.spare = None
        self.closed = False

    def start(self, argv, cwd, env, marker):
        """A Popen that becomes `argv`, confined, in `cwd` with `env` (stdin /dev/null)."""
        with self.lock:
            proc, self.spare = self.spare, None
            # (the protected paths looked up once per command)
            early_spec = self.sandbox.spec(None)
            if proc is not None and (proc.poll() is not None or proc.early_spec != early_spec):
                # dead, or confined for settings changed since
                os.close(proc.control)
                kill_group(proc)
                proc = None
            if proc is None:
                proc = self.spawn(early_spec)
            try:
                msg = json.dumps({"spec": json.dumps(dict(json.loads(early_spec), cwd=cwd)),
                                  "argv": argv, "env": env})
                os.write(proc.control, msg.encode("utf-8", "surrogateescape") + b"\n")
            except OSError:
                kill_group(proc)
                raise
            finally:
                os.close(proc.control)
            proc.boris_call = marker
        threading.Thread(target=self.refill, daemon=True, name="boris-launcher-refill").start()
        return proc

    def refill(self):
        """Start the next spare, off the path of the command just started (a Python
        starting beside it); none once closed, or when one is there already."""
        with self.lock:
            if self.closed or self.spare is not None:
                return
            try:
                self.spare = self.spawn()
            except OSError:
                self.spare = None  # none to be had now: the next command starts its own

    def spawn(self, early_spec=None):
        """Start a sandbox launcher that waits on a pipe for the command to run, confined
        ahead as `early_spec` (the spec without a cwd; made now when not given)."""
        import subprocess
        r, w = os.pipe()
        try:
            launcher, private = helper_command("sandbox", avoid=self.sandbox.writable)
            early_spec = early_spec or self.sandbox.spec(None)  # confined now, ahead of its command
            proc = spawn(launcher + ["@%d" % r, early_spec], cwd=private, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         close_fds=True, pass_fds=(r,))
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        proc.control, proc.early_spec = w, early_spec
        return proc

    def close(self):
        """Stop the spare launcher, if one is waiting, and start no more."""
        with self.lock:
            proc, self.spare, self.closed = self.spare, None, True
        if proc is not None:
            os.close(proc.control)                  # its end of input: it exits
            kill_group(proc)


class Sandbox:
    """How commands are confined: the mode ('off', 'workspace-write', 'read-only'),
    the directories they may write beneath, whether they may use the network, and
    the kernel features that do it. off() confines nothing."""

    def __init__(self, mode="off", writable=(), network=True, abi=0, why="", protect=None,
                 domains=()):
        self.mode, self.writable, self.network, self.abi = mode, list(writable), network, abi
        self.why = why                                  # how the mode was chosen, for the log
        self.protect = protect or Protect()
        self.domains = list(domains)                    # with the network off: the proxy's domains
        self.proxy_port = None                          # the proxy's loopback port, once the
                                                        # server runs it (on, the network off)
        self.launchers = Launchers(self)                # (a spare one starts
                                                        # with the first command)
        self.trials = {}                                # what probe_sandbox's
                                                        # launcher tried, and got

    def close(self):
        """Stop the warm launchers."""
        self.launchers.close()

    @staticmethod
    def writable_roots(mode, policy):
        """Where commands may write: the allowed directories (or the workspace) and the temp
        directory; only the temp directory when read-only. Nested ones go."""
        roots = ([] if mode == "read-only"
                 else list(policy.allow) or [policy.workdir]) + [temp_dir()]
        return sorted({r for r in roots
                       if r and not any(r != o and is_within(r, o) for o in roots if o)})

    @classmethod
    def off(cls, why="--sandbox off"):
        """A Sandbox that confines nothing; `why` says why in the log and the instructions."""
        return cls(why=why)

    @property
    def on(self):
        """Whether commands are confined."""
        return self.mode != "off"

    def net_mechanism(self):
        """'landlock' or 'netns' when the network is cut, else None."""
        if not self.on or self.network:
            return None
        return "landlock" if self.abi >= 4 else "netns"

    def spec(self, cwd, ctty=False, tied=False):
        """What the launcher needs, as JSON: it starts in its private directory and
        moves to the command's `cwd` once confined; `ctty`: make stdin (a terminal)
        the controlling terminal, so Ctrl-C reaches the command; `tied`: it dies with
        this process's thread that starts it."""
        return json.dumps({"mode": self.mode, "writable": self.writable, "abi": self.abi,
                           "net": self.net_mechanism(), "cwd": cwd, "ctty": ctty,
                           "tied": os.getpid() if tied else None,
                           "protect": self.protect.paths(self.writable) if self.on else [],
                           "proxy": self.proxy_port})

    def launched(self, argv, cwd, ctty=False, tied=False):
        """(argv, cwd) that run `argv` in `cwd` through a launcher confined by this
        sandbox (the launcher starts in its private directory; spec says the rest)."""
        launcher, private = helper_command("sandbox", avoid=self.writable)
        return launcher + [self.spec(cwd, ctty, tied)] + argv, private

    def proxy_environ(self):
        """The variables that send a command's HTTP and HTTPS through the proxy ({} without one)."""
        if not self.proxy_port:
            return {}
        url = "http://127.0.0.1:%d" % self.proxy_port
        names = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
        return dict(dict.fromkeys(names, url), NO_PROXY="", no_proxy="")

    def network_words(self):
        """What the network is for commands, in a few words."""
        if self.network:
            return "network on"
        if self.domains:
            return "network only to %s (through boris's proxy%s)" % (
                ", ".join(self.domains),
                " on 127.0.0.1:%d" % self.proxy_port if self.proxy_port else "")
        return "network off"

    def describe(self):
        """One line for the instructions and the start-up log."""
        if not self.on:
            return "Sandbox: off (bash commands can write anywhere this user can)"
        where = ", ".join(self.writable)
        return "Sandbox: %s (bash commands may write only under %s; %s; %s; Landlock ABI %d)" % (
            self.mode, where, self.protect.describe(), self.network_words(), self.abi)

    def hint(self, text):
        """The line a failed sandboxed command's result ends with, when its output
        shows a refused write or connect; else ''."""
        refusals = (r"Permission denied|Read-only file system|Operation not permitted"
                    r"|Device or resource busy")
        network = ""
        if not self.network:
            refusals += r"|Network is unreachable"
            network = " and may not use the network"
            if self.domains:
                refusals += r"|403|[Tt]unnel|boris sandbox proxy"  # what clients say of its 403
                network = (" and reach only %s, through boris's proxy (HTTP_PROXY, HTTPS_PROXY)"
                           % ", ".join(self.domains))
        if not self.on or not re.search(refusals, text):
            return ""
        protected = self.protect.paths(self.writable)
        return ("[sandbox %s: commands may write only under %s%s%s; the server's --allow-dir adds"
                " directories,%s --sandbox off lifts it]"
                % (self.mode, ", ".join(self.writable),
                   ", never to %s (--sandbox-protect)" % ", ".join(protected) if protected else "",
                   network,
                   "" if self.network else " --sandbox-network on allows the network"
                   " (or lists domains),"))


def resolve_sandbox(config, policy, abi=None):
    """The Sandbox that --sandbox/--sandbox-network ask for on this kernel, in the strongest
    form probe_sandbox finds working here. An explicit mode the kernel cannot give raises
    ConfigError (one line, exit 2); auto without it falls back to off with a warning."""
    mode = config.sandbox
    if mode == "off":
        return Sandbox.off("--sandbox off")
    if mode == "auto" and not policy.allow:
        return Sandbox.off("--sandbox auto: no --allow-dir")
    abi = landlock_abi() if abi is None else abi
    network = config.sandbox_network is True            # None: the sandbox decides, and it says off
    domains = config.sandbox_network if isinstance(config.sandbox_network, list) else []
    why, refusal = kernel_refusal(mode, abi, network, domains)
    if why is None:
        sandbox = Sandbox("workspace-write" if mode == "auto" else mode,
                          Sandbox.writable_roots(mode, policy), network, abi, "--sandbox %s" % mode,
                          Protect.of(config, policy), domains)
        why = probe_sandbox(sandbox)
        if why and (sandbox.protect.wanted() or sandbox.net_mechanism() == "netns"):
            # the namespaces failed, most likely: without them?
            why += userns_refusal()
            if sandbox.net_mechanism() == "netns":
                raise ConfigError(
                    "--sandbox-network off cannot be honoured: Landlock ABI %d has no TCP rules"
                    " and a network namespace cannot be made here (%s); pass --sandbox-network on"
                    % (abi, why))
            if config.sandbox_protect:
                raise ConfigError(
                    "--sandbox-protect cannot be honoured: its read-only mounts need a user"
                    " namespace, which cannot be made here (%s); pass --sandbox-protect none" % why)
            sandbox.protect.enforced, sandbox.protect.why = False, why
            log("warn", "sandbox: %s: %s" % (sandbox.protect.describe(), why))
            why = probe_sandbox(sandbox)
        if why is None:
            return sandbox
        refusal = "--sandbox %s cannot be honoured: %s" % (mode, why)
    if mode == "auto":
        log("warn", "sandbox off: %s; bash commands can write anywhere this user can" % why)
        return Sandbox.off("--sandbox auto: " + why)
    raise ConfigError(refusal)


def kernel_refusal(mode, abi, network, domains):
    """(why this kernel cannot give the sandbox asked for, the line refusing it), or
    (None, None) when nothing it lacks is known before a probe."""
    if not abi:
        why = ("Landlock is not to be had: this kernel lacks it (Linux 5.13+ with landlock among"
               " its LSMs), or a seccomp profile (a container's) refuses it")
        if not sys.platform.startswith("linux"):
            why = ("the sandbox needs Linux Landlock; %s is not supported (macOS sandbox-exec is"
                   " not done yet)" % sys.platform)
        elif not importable("ctypes"):
            why = ("the sandbox (Landlock) needs Python's ctypes module, which this Python was"
                   " built without")
        return why, "--sandbox %s cannot be honoured: %s" % (mode, why)
    if domains and abi < 6:
        why = ("a domain list needs Landlock ABI 6 (Linux 6.7+: TCP rules and scoped sockets, for"
               " the proxy's one port); this kernel has ABI %d" % abi)
        return why, ("--sandbox-network %s cannot be honoured: %s; pass on or off"
                     % (",".join(domains), why))
    if not network and not net_filter_available():
        why = ("seccomp filters are not available on this kernel or machine (%s), so Unix sockets"
               " and UDP could not be cut" % os.uname().machine)
        return why, (
            "--sandbox %s with the network off cannot be honoured: %s; pass --sandbox-network on"
            % (mode, why))
    return None, None


def userns_refusal():
    """Why this system refuses unprivileged user namespaces,
    where a switch says so: ' (...)', else ''."""
    for switch, refuses, words in (
            ("kernel.apparmor_restrict_unprivileged_userns", "1",
             "AppArmor restricts them, as on Ubuntu 24.04;"
             " sysctl kernel.apparmor_restrict_unprivileged_userns=0 lifts it"),
            ("user.max_user_namespaces", "0", "user.max_user_namespaces is 0"),
            ("kernel.unprivileged_userns_clone", "0", "kernel.unprivileged_userns_clone is 0")):
        try:
            with open("/proc/sys/" + switch.replace(".", "/")) as f:
                if f.read().strip() == refuses:
                    return " (%s)" % words
        except OSError:
            continue                                    # no such switch here
    return ""


def probe_sandbox(sandbox):
    """None when `sandbox` confines a launcher here and holds, else what failed, in words.
    The launcher (helper_probe) is confined as the sandbox's commands are, but for the
    paths: in a scratch directory of the temp directory it may write in/ alone, with
    in/.git protected; it tries those writes and a connect to a loopback port, which must
    go as the sandbox says. Without a temp directory only the confinement is tried."""
    import shutil
    import socket
    import tempfile
    spec, scratch, base = json.loads(sandbox.spec("/")), None, temp_dir()
    listener = socket.socket()
    try:
        if base:
            scratch = tempfile.mkdtemp(prefix="boris-probe-", dir=base)
            for name in ("in", "out", "in/.git"):
                os.mkdir(os.path.join(scratch, name))
            spec.update(cwd=scratch, writable=[scratch + "/in"],
                        protect=[scratch + "/in/.git"] * sandbox.protect.wanted())
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        argv, private = helper_command("probe", avoid=sandbox.writable)
        code, out, err = run_program(argv + [json.dumps(spec), str(listener.getsockname()[1])],
                                     private, PROBE_S)
    except OSError as e:
        return "the probe could not run (%s)" % e
    finally:
        listener.close()
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    said = err.decode("utf-8", "replace").strip()
    try:
        trials = json.loads(out.decode("utf-8", "replace"))
    except ValueError:
        return re.sub(r"^boris: |; the command was not run$", "", said.splitlines()[-1] if said else
                      "the probe ended with exit code %s" % code)
    sandbox.trials = trials
    allowed = {"a write inside": True, "a write outside": False,
               "a write to a protected .git": not spec["protect"],
               "a loopback connect": sandbox.network}
    wrong = ["%s: %s" % (k, v) for k, v in sorted(trials.items()) if (v == "done") != allowed[k]]
    return "it did not hold (%s)" % "; ".join(wrong) if wrong else None


def helper_probe(spec, port):
    """probe_sandbox's launcher: confined as `spec` says, it tries the writes and the
    connect and prints what each got ('done', or its error) as JSON."""
    import socket
    spec = confined(spec)
    tries = [("a loopback connect", socket.create_connection, (("127.0.0.1", int(port)),))]
    if spec["cwd"] != "/":
        tries += [(name, open, (os.path.join(spec["cwd"], where, "x"), "x")) for name, where in (
            ("a write inside", "in"), ("a write outside", "out"),
            ("a write to a protected .git", "in/.git"))]
    trials = {}
    for name, act, arg in tries:
        try:
            act(*arg).close()
            trials[name] = "done"
        except OSError as e:
            trials[name] = e.strerror or str(e)
    sys.stdout.write(json.dumps(trials))
    return 0


def become(cwd, argv):
    """A confined launcher's last step: into `cwd`, SIGINT and SIGQUIT back to their
    defaults (a server started with them ignored, a script's background job, must not
    hand that on, or Ctrl-C on a command's terminal never reaches it: a shell cannot
    undo it), then exec `argv`."""
    try:
        os.chdir(cwd)
    except OSError as e:
        refuse_to_run(e)
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    os.execv(argv[0], argv)


def helper_warm_launcher(fd, early_spec):
    """A launcher started ahead: confined ahead as the JSON `early_spec` says (the spec but
    its cwd: with the network off, the supervisor is forked now too), then waiting on
    pipe `fd` for one JSON line {spec, argv, env} to become that command in the spec's
    cwd. The end of the pipe without a line (the server stopped, or closed this
    spare) ends it; a spec other than the one it was confined for is refused."""
    _libc()
    # NetSupervisor's, loaded ahead (socket: ~15 ms)
    for name in ("select", "socket"):
        __import__(name)
    confined(early_spec)
    with os.fdopen(fd, "rb") as control:
        line = control.readline()
    if not line:
        os._exit(0)
    try:
        job = json.loads(line.decode("utf-8", "surrogateescape"))
        os.environ.clear()
        os.environ.update(job["env"])
        cwd = json.loads(job["spec"]).pop("cwd")
        if job["spec"] != json.dumps(dict(json.loads(early_spec), cwd=cwd)):
            raise ValueError("a spec other than the one this launcher was confined for")
    except (ValueError, KeyError, TypeError) as e:
        sys.stderr.write("boris: the sandbox launcher got no usable command (%s); nothing was run\n"
                         % e)
        os._exit(SANDBOX_EXIT)
    become(cwd, job["argv"])


def helper_sandbox(spec, argv):
    """The launcher: confine this process as `spec` says, then become `argv`."""
    become(confined(spec)["cwd"], argv)


def confined(spec):
    """Confine this process as the JSON `spec` says (with the network off, this is the
    command-to-be once NetSupervisor.confine has forked its supervisor); the spec. Any
    failure ends it with SANDBOX_EXIT and a line on stderr: a command never runs
    less confined than asked."""
    try:
        spec = json.loads(spec)
        if spec.get("tied") and os.fork():
            # this launcher stays, to kill the program's whole group (a language server's
            # own children too) when boris dies, however it dies
            signal.signal(signal.SIGHUP, lambda *_: os.killpg(0, signal.SIGKILL))
            if prctl(PR_SET_PDEATHSIG, signal.SIGHUP) and os.getppid() != spec["tied"]:
                os.killpg(0, signal.SIGKILL)
            os._exit(os.wait()[1] >> 8)
        if spec.get("ctty"):                    # a session leader (start_new_session) takes its tty
            import fcntl
            import termios
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        if spec["mode"] != "off":
            if spec["net"] == "netns" or spec["protect"]:
                enter_namespaces(spec["net"] == "netns", spec["protect"])
            landlock = Landlock(spec)
            landlock.restrict()
            if spec["net"]:
                NetSupervisor.confine(spec, landlock)
            landlock.close()
    except Exception as e:
        # whatever failed, the command must not run unconfined
        refuse_to_run(e)
    return spec


def refuse_to_run(e):
    """End a launcher that could not confine its command: a line on stderr, SANDBOX_EXIT."""
    sys.stderr.write("boris: the sandbox could not be set up (%s); the command was not run\n" % e)
    sys.stderr.flush()
    os._exit(SANDBOX_EXIT)


# -- the egress proxy -------------------------------------------------------------
# EgressProxy is the one door of sandboxed commands to the domains --sandbox-network lists.
PROXY_CONNECTIONS = 64                     # the proxy's connections at
                                           # once; one more is answered 503
PROXY_HEAD_BYTES = 65536                   # a request head longer than this is refused (431)
PROXY_IDLE_S = 300.0                       # a tunnel with no byte either
                                           # way for this long is closed
PROXY_CONNECT_S = 20.0                     # reading a request head, and
                                           # connecting upstream, at most


class EgressProxy:
    """The loopback HTTP proxy that sandboxed commands reach the listed `domains` through
    (CONNECT for HTTPS, absolute-form requests for plain HTTP), on 127.0.0.1 at `port`.
    A name not listed, an IP address, or a name matched by a *. pattern that resolves to
    an address that is not global (DNS rebinding: `internal`) is answered 403 with the
    reason and logged; nothing else is connected. A name listed exactly may resolve to
    any address: the user named that host (localhost for a local package mirror, say).
    `hosts` maps names to addresses taken as they are (the tests' resolver: loopback only).
    close() stops it and every tunnel."""

    def __init__(self, domains, hosts=None):
        import socket
        self.domains, self.hosts = list(domains), dict(hosts or {})
        self.lock = threading.Lock()
        self.open = set()                           # the sockets of the connections being served
        self.closed = False
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(PROXY_CONNECTIONS)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True, name="boris-proxy").start()

    def accept(self):
        """Take connections until closed; one thread each, PROXY_CONNECTIONS at most."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return                              # closed
            with self.lock:
                full = len(self.open) >= PROXY_CONNECTIONS or self.closed
                if not full:
                    self.open.add(conn)
            if full:
                self.answer(conn, 503,
                            "the proxy has %d connections open already" % PROXY_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self.serve, args=(conn,), daemon=True,
                             name="boris-proxy-conn").start()

    def serve(self, conn):
        """One client connection: its request head read, the target decided, then relayed."""
        import socket
        upstream = None
        try:
            conn.settimeout(PROXY_CONNECT_S)
            head = b""
            while b"\r\n\r\n" not in head:
                block = conn.recv(65536)
                if not block:
                    return
                head += block
                if len(head) > PROXY_HEAD_BYTES:
                    return self.answer(conn, 431, "a request head over %d bytes" % PROXY_HEAD_BYTES)
            head, rest = head.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3:
                return self.answer(conn, 400, "a malformed request line")
            method, target, version = parts
            host, port, path = self.target(method, target)
            if host is None:
                return self.answer(conn, 400,
                                   "%s %s is neither CONNECT host:port nor an http:// URL"
                                   % (method, target))
            addresses, why = self.decide(host)
            failed = None
            if why:
                log("warn", "the sandbox proxy refused a connection",
                    host=host, port=port, reason=why)
                return self.answer(conn, 403, why)
            for address in addresses:
                try:
                    upstream = socket.create_connection((address, port), PROXY_CONNECT_S)
                    break
                except OSError as e:
                    failed = e
            if upstream is None:
                return self.answer(conn, 502,
                                   "%s:%d could not be reached (%s)" % (host, port, failed))
            with self.lock:
                self.open.add(upstream)
            if method == "CONNECT":
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                # the request goes on in origin form, without Proxy-* fields
                kept = [l for l in lines[1:] if not l.lower().startswith("proxy-")]
                upstream.sendall(("\r\n".join(["%s %s %s" % (method, path, version)] + kept)
                                  + "\r\n\r\n").encode("latin-1"))
            if rest:
                upstream.sendall(rest)
            self.relay(conn, upstream)
        except (OSError, ValueError, UnicodeError):
            pass  # the client or the server went away: the connection just ends
        finally:
            for sock in filter(None, (conn, upstream)):           # (no upstream: None)
                with self.lock:
                    self.open.discard(sock)
                sock.close()

    @staticmethod
    def target(method, target):
        """(host, port, origin-form path) of a request's
        target; (None, None, None) if it has none."""
        import urllib.parse
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            host = host.strip("[]")
            if host and port.isdigit() and 0 < int(port) < 65536:
                return host, int(port), None
            return (None,) * 3
        parts = urllib.parse.urlsplit(target)
        if parts.scheme.lower() != "http" or not parts.hostname:
            return None, None, None
        path = parts.path or "/"
        return parts.hostname, parts.port or 80, path + ("?" + parts.query if parts.query else "")

    def decide(self, host):
        """(addresses to connect, None) when `host` may be reached, else (None, why)."""
        import socket
        if not host_allowed(host, self.domains):
            return None, ("%s is not among the domains sandboxed commands may reach"
                          " (--sandbox-network %s)" % (host, ",".join(self.domains)))
        name = host.lower().rstrip(".")
        if name in self.hosts:
            return [self.hosts[name]], None
        try:
            infos = socket.getaddrinfo(name, None, 0, socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            return None, "%s could not be resolved (%s)" % (host, e)
        addresses = [info[4][0] for info in infos]
        for address in addresses if name not in self.domains else ():
            why = self.internal(address)
            if why:
                return None, ("%s resolves to %s, %s: refused (DNS rebinding; only a name listed"
                              " exactly, not by a *. pattern, may lead to one)"
                              % (host, address, why))
        return addresses, None

    @staticmethod
    def internal(address):
        """What makes `address` one a name matched by a pattern must not lead to (the host
        itself, its link, any network that is not the public internet, as IANA's registries
        say through ipaddress), or None."""
        import ipaddress
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        ip = getattr(ip, "ipv4_mapped", None) or ip
        if ip.is_loopback or ip.is_unspecified or ip.is_multicast:
            return "a loopback, unspecified or multicast address"
        if ip.is_link_local:
            return "a link-local address (cloud metadata services live there)"
        if not ip.is_global:
            return "an address of an internal or reserved network"
        return None

    @staticmethod
    def answer(conn, status, why):
        """Send an error response whose body says why, as boris's proxy."""
        import http
        body = ("boris sandbox proxy: %s\n" % why).encode("utf-8")
        reason = http.HTTPStatus(status).phrase
        try:
            conn.sendall(b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                         % (status, reason.encode(), len(body), body))
        except OSError:
            pass  # the client left first

    def relay(self, a, b):
        """Copy bytes both ways until both sides have ended, or PROXY_IDLE_S pass without one."""
        import socket
        a.settimeout(None)
        b.settimeout(None)
        ends = {a: b, b: a}
        while ends:
            readable = ready(list(ends), PROXY_IDLE_S)
            if not readable:
                return
            for sock in readable:
                data = sock.recv(65536)
                if data:
                    ends[sock].sendall(data)
                    continue
                try:
                    ends.pop(sock).shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # the other side is closed already

    def close(self):
        """Stop taking connections and end every open one."""
        with self.lock:
            self.closed = True
            socks, self.open = list(self.open), set()
        for sock in [self.listener] + socks:
            try:
                sock.shutdown(2)
            except OSError:
                pass  # not connected
            sock.close()


###############################################################################
# Search ######################################################################
###############################################################################
# Ignore rules (.gitignore and friends), inotify watches and the walk cache they keep
# warm, one walker (gitignore-aware, cycle-safe, scope-filtered), one grep engine
# (Matcher, LineRecords) and the outline engine; the glob compiler is in Paths above.
# grep, glob, search_text, search_files and outline are thin front-ends over these.

GREP_BINARY_SNIFF = 512                    # a NUL in a file's first bytes makes it binary
SEARCH_BATCH = 1000                        # results a helper sends at a time
# A grep or glob of a directory is dealt out to a helper per core, each walking and
# searching its own slice of the tree (Walker.deal); the same slice goes to the same
# helper, whose cache stays warm for it.
SEARCH_SLICES = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                           else os.cpu_count() or 1, 4))
# search helpers kept warm for the next search (or one for each slice)
SEARCH_IDLE_HELPERS = 2
# a directory with fewer subdirectories passes them on whole
SLICE_FANOUT = 4
# a helper past its job's deadline by this much ends itself
DEADLINE_GRACE_S = 2.0
GREP_BUFFER = 1 << 20                  # reused read buffer; big files go in chunks of it
GREP_CHUNK_MAX = 16 << 20              # a single line longer than this is cut
# ignore files a helper keeps compiled (unchanged ones are not re-read)
IGNORE_CACHE_FILES = 4096
# entries of directory listings a helper keeps (a name, a kind and an inode each: an LRU
# smaller than a walk it repeats misses every time)
LISTING_CACHE_ENTRIES = 1000000
# glob answers a helper keeps while nothing they came from changes
GLOB_RESULTS_KEPT = 8
LISTING_RACY_S = 1.0                   # a directory changed this recently is walked again next time
_REGEX_META = frozenset("\\.^$*+?{}[]|()")

TYPES = {                      # ripgrep's globs for these languages, and a few more
    "c": "*.c *.h *.H *.c.in *.h.in *.cats",
    "cpp": "*.C *.cpp *.cc *.cxx *.c++ *.h *.H *.hpp *.hh *.hxx *.h++ *.inl *.cppm *.ixx *.cpp.in"
           " *.hpp.in *.cc.in",
    "cs": "*.cs *.csx", "css": "*.css *.scss *.sass *.less",
    "clojure": "*.clj *.cljs *.cljc *.cljx *.edn", "cmake": "*.cmake CMakeLists.txt",
    "d": "*.d", "dart": "*.dart", "docker": "*Dockerfile* *.dockerfile",
    "elixir": "*.ex *.exs *.eex", "elm": "*.elm", "erlang": "*.erl *.hrl",
    "fsharp": "*.fs *.fsi *.fsx", "go": "*.go", "graphql": "*.graphql *.gql",
    "groovy": "*.groovy *.gradle", "haskell": "*.hs *.lhs *.hsc",
    "html": "*.html *.htm *.xhtml *.ejs", "java": "*.java *.jsp *.jspx *.properties",
    "js": "*.js *.jsx *.mjs *.cjs *.vue", "json": "*.json *.jsonc composer.lock", "julia": "*.jl",
    "kotlin": "*.kt *.kts", "lua": "*.lua",
    "make": "Makefile makefile GNUmakefile gnumakefile *.mk *.mak Makefile.am Makefile.in",
    "markdown": "*.md *.markdown *.mdown *.mkdn *.mdx", "nim": "*.nim *.nimble *.nimf *.nims",
    "nix": "*.nix", "objc": "*.m *.mm *.h", "ocaml": "*.ml *.mli *.mll *.mly",
    "perl": "*.pl *.pm *.t *.PL *.perl *.plh *.plx",
    "php": "*.php *.php3 *.php4 *.php5 *.phtml", "proto": "*.proto", "py": "*.py *.pyi *.pyw",
    "r": "*.r *.R *.Rmd *.Rnw",
    "ruby": "*.rb *.rbw *.rake *.gemspec Gemfile Rakefile .irbrc config.ru",
    "rust": "*.rs", "scala": "*.scala *.sc *.sbt",
    "sh": "*.sh *.bash *.zsh *.csh *.ksh *.tcsh .bashrc .zshrc .bash_profile .bash_login .profile"
          " .zshenv .zprofile .cshrc .kshrc",
    "sql": "*.sql *.psql", "svelte": "*.svelte", "swift": "*.swift",
    "tex": "*.tex *.sty *.cls *.bib *.ltx *.dtx *.ins", "toml": "*.toml Cargo.lock",
    "ts": "*.ts *.tsx *.mts *.cts", "txt": "*.txt", "vue": "*.vue",
    "xml": "*.xml *.xsd *.xsl *.xslt *.dtd *.rng *.xml.dist *.svg", "yaml": "*.yaml *.yml",
    "zig": "*.zig",
}
TYPE_ALIASES = {"python": "py", "typescript": "ts", "javascript": "js", "md": "markdown",
                "rs": "rust", "rb": "ruby", "golang": "go", "c++": "cpp", "csharp": "cs",
                "shell": "sh", "bash": "sh", "yml": "yaml", "kt": "kotlin", "hs": "haskell",
                "makefile": "make", "dockerfile": "docker"}


def type_matcher(name):
    """A function basename -> bool for a language name, or ToolError(GREP_INVALID_TYPE)."""
    key = TYPE_ALIASES.get(name.lower(), name.lower())
    if key not in TYPES:
        raise ToolError(GREP_INVALID_TYPE, "unknown type %r; valid types: %s (aliases: %s)" % (
            name, ", ".join(sorted(TYPES)),
            ", ".join("%s=%s" % kv for kv in sorted(TYPE_ALIASES.items()))))
    rx = re.compile("|".join("(?:%s)" % compile_glob(g).pattern for g in TYPES[key].split()))
    return lambda base: rx.match(base) is not None


# -- .gitignore ---------------------------------------------------------------

class IgnoreFile:
    """The rules of one .gitignore (or info/exclude) at `source`, relative to `base`."""

    def __init__(self, base, lines, source=None):
        self.base, self.source = base, source
        self.rules = []                      # (pattern as git sees it, negated, dir_only, anchored)
        for raw in lines:
            line, neg, dir_only = ignore_pattern(raw)
            if line:                         # git matches bytes: '?' is one byte of UTF-8
                self.rules.append((as_bytes(line[1:] if line.startswith("/") else line), neg,
                                   dir_only, "/" in line))
        self.runs = self.combined(self.rules)

    @staticmethod
    def combined(rules):
        """The rules as few tests: each run of consecutive rules that all ignore (or all
        re-include) becomes, last run first, (negated, (the tests of a file, those of a
        directory)), indexed by is_dir: dir-only rules test directories only. Within a
        run any match gives the same verdict, so a test is a set of literal names, a
        tuple of suffixes ('*.o'), the literal paths (as {'dir/': names}), one regex of
        the rest by name (alternatives tried in C) and those by path, one for each
        number of components they match ({n: regex}; None for any number): most rules
        are literals, checked without a regex, and a path glob is tried only at its
        depth. A rule git would not match either (a malformed pattern) is dropped."""
        magic, out = set("*?[\\"), []
        runs = [(neg, list(run)) for neg, run in groupby(rules, itemgetter(1))]
        for neg, members in reversed(runs):
            tests = []
            for for_dir in (False, True):
                # literal paths by the directory they name a child of; path globs by how
                # many components they match (None: any)
                names, suffixes, within, by_name, deep = set(), set(), {}, [], {}
                for pat, _, dir_only, anchored in members:
                    if dir_only and not for_dir:
                        continue
                    if anchored and magic.isdisjoint(pat):
                        head, _, tail = pat.rpartition("/")
                        within.setdefault(head + "/" if head else "", set()).add(tail)
                    elif anchored:
                        deep.setdefault(None if "**" in pat or "[" in pat
                                        else pat.count("/") + 1, []).append(pat)
                    elif magic.isdisjoint(pat):
                        names.add(pat)
                    elif pat[0] == "*" and magic.isdisjoint(pat[1:]):
                        suffixes.add(pat[1:])
                    else:
                        by_name.append(pat)
                tests.append((frozenset(names), tuple(suffixes), within, one_regex(by_name),
                              {n: one_regex(pats) for n, pats in deep.items()}))
            out.append((neg, tests))
        return out

    def sift(self, pre, names, is_dir, hidden):
        """The rules' verdict on entries of one directory at once, the last rule that matches
        deciding: `names` (all directories or all files) whose paths relative to self.base
        are pre + name; adds those ignored to `hidden` and returns those no rule here
        decides. Sets do what they can in C. Names not ASCII are tested as git sees them
        (as_bytes)."""
        back = None
        if not (pre + "".join(names)).isascii():
            back = {as_bytes(name): name for name in names}
            pre, names = as_bytes(pre), back
        left = set(names)
        for neg, tests in self.runs:
            literal, suffixes, paths, by_name, by_path = tests[is_dir]
            hit = left & literal | left.intersection(paths.get(pre, ()))
            if suffixes:
                hit.update(filter(methodcaller("endswith", suffixes), left))
            hit.update(filter(by_name.match, left))
            for rx in at_depth(by_path, pre.count("/") + 1):
                hit.update([name for name in left if rx.match(pre + name)])
            left -= hit
            if not neg:
                hidden.update(hit if back is None else map(back.get, hit))
        return left if back is None else [back[name] for name in left]


def at_depth(by_path, n):
    """The path regexes of a run that can match a path of n components."""
    return [rx for rx in (by_path.get(n), by_path.get(None)) if rx is not None]


def one_regex(patterns):
    """One compiled regex matching what any of the git globs `patterns` matches (each
    whole; nothing for none); a pattern git would not match (malformed) is left out."""
    sources = []
    for pat in patterns:
        try:
            sources.append(glob_source(pat, git=True))
        except ValueError:
            continue                         # git ignores a malformed pattern too
    try:
        return re.compile("|".join(map("(?:{})".format, sources)) or "(?!)", re.DOTALL)
    except (re.error, RecursionError, OverflowError):
        pass                                 # one of them does not compile: find it, keep the rest
    kept = []
    for src in sources:
        try:
            re.compile(src)
            kept.append(src)
        except (re.error, RecursionError, OverflowError):
            continue
    return re.compile("|".join(map("(?:{})".format, kept)) or "(?!)", re.DOTALL)


def ignore_pattern(raw):
    """(pattern, negated, directories only) of a .gitignore line; pattern '' for a
    blank line or a comment. Unescaped trailing spaces go; '\\!' and '\\#' are literal."""
    line = raw.rstrip("\n").rstrip("\r")
    if line.startswith("#"):
        return "", False, False
    while line.endswith(" ") and not line.endswith("\\ "):
        line = line[:-1]
    neg = line.startswith("!")
    if line.startswith(("!", "\\!", "\\#")):
        line = line[1:]
    dir_only = line.endswith("/")
    if dir_only:
        line = line[:-1]             # one slash: 'foo//' is 'foo/' anchored, which names nothing
    return line, neg, dir_only


def as_bytes(text):
    """Text as its UTF-8 bytes, one character a byte (latin-1): how git's fnmatch sees it."""
    return text if text.isascii() else text.encode("utf-8", "surrogateescape").decode("latin-1")


def read_ignore(base, source):
    """The rules of the ignore file `source` for directory `base`, or None if it has none."""
    try:
        # (a FIFO or a device put there, or linked to, would block the walk or never end)
        with open(os.open(source, os.O_RDONLY | os.O_NONBLOCK | O_CLOEXEC), "r",
                  encoding="utf-8", errors="replace") as f:
            regular = stat.S_ISREG(os.fstat(f.fileno()).st_mode)
            rules = IgnoreFile(base, f.readlines() if regular else [], source)
    except OSError:
        return None  # unreadable: no rules from it (git, too, skips it)
    return rules if rules.rules else None


def git_top(start):
    """The work tree containing `start` (a directory holding .git), or None."""
    d = start
    while True:
        if os.path.exists(os.path.join(d, ".git")):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def same_objects(a, b):
    """Whether two sequences hold the very same objects, in order."""
    return len(a) == len(b) and all(map(is_, a, b))


def ignored_among(stack, path, names, is_dir):
    """The set of `names` (entries of the directory `path`, all directories or all files)
    that an ignore stack hides: the innermost file with a matching rule decides, a level
    at a time for all."""
    hidden, left, inside = set(), names, child_prefix(path)
    for rules in reversed(stack):
        if not left:
            break
        left = rules.sift(inside[len(child_prefix(rules.base)):], left, is_dir, hidden)
    return hidden


# -- watches and the walk cache ---------------------------------------------------
# A warm helper watches the directories it walked twice (inotify, through ctypes), so
# a walk of a tree that has not changed since needs no system call per directory nor
# per file: the kernel queues an event for every change to a watched directory's
# entries or files - made by anyone, through any path - before the change's system
# call returns, and each walk reads the queue first. Only on filesystems whose changes
# all pass through this kernel (not NFS, FUSE or other network filesystems).
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW = 0x400, 0x800, 0x4000
IN_IGNORED, IN_ISDIR = 0x8000, 0x40000000
IN_ONLYDIR, IN_DONT_FOLLOW = 0x01000000, 0x02000000
# a directory's listing changed
IN_ENTRIES = IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
IN_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED | IN_Q_OVERFLOW
WATCH_MASK = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_ENTRIES | IN_DELETE_SELF | IN_MOVE_SELF \
    | IN_ONLYDIR | IN_DONT_FOLLOW
# directories a helper watches, at most (and an 8th of the user's limit)
WATCHES_MAX = 100000
# statfs f_type of filesystems whose changes all raise events here
LOCAL_FILESYSTEMS = frozenset((
    0xEF53, 0x58465342, 0x9123683E, 0x01021994, 0x794C7630, 0x2FC12FC1, 0xF2F52010, 0x52654973,
    0x3153464A, 0xCA451A4E, 0x858458F6, 0x4D44, 0x2011BAB0, 0x5346544E))
# ext2-4, xfs, btrfs, tmpfs, overlayfs, zfs, f2fs, reiserfs, jfs, bcachefs, ramfs, vfat, exfat, ntfs


class Watches:
    """The directories a warm helper (or a session's checkpoints) watches, and what their
    events leave standing: `clean`, the directories whose entries have not changed since
    they were watched and checked, with the (mtime, ctime) they were checked at; and
    `quiet`, the directories a reader (a checkpoint) looked at whole while they were
    watched, until any event about them or their entries. An overflowed queue forgets
    everything; a directory deleted or moved forgets itself and all below it; a file made
    that has (or may have had) other hard links, a directory made, or a .gitignore touched
    makes no directory quiet any more. A hard link made from a directory not watched
    (outside the roots, or ignored) to a file inside raises no event, nor do changes
    through it. Where inotify is missing (not Linux, no ctypes, out of instances) nothing
    is watched, and every repeated walk stats its directories and files."""

    def __init__(self):
        self.fd, self.libc = None, None            # opened at the first watch
        self.broken = not sys.platform.startswith("linux")
        self.wds, self.of = {}, {}                 # watch descriptor <-> directory
        self.clean, self.quiet, self.devs = {}, set(), {}
        self.limit = WATCHES_MAX
        # events taken so far: unchanged, nothing watched changed
        self.generation = 0

    def open(self):
        """The inotify descriptor, opened now if need be; None where it is not to be had."""
        if self.fd is None and not self.broken:
            try:
                _, self.libc = _libc()
                fd = self.libc.inotify_init1(os.O_NONBLOCK | O_CLOEXEC)
                with open("/proc/sys/fs/inotify/max_user_watches") as f:
                    self.limit = min(WATCHES_MAX, int(f.read()) // 8)
            except (OSError, AttributeError, ImportError, ValueError):
                fd = -1
            if fd < 0:
                self.broken = True
                log("debug", "no inotify here: every repeated walk stats its directories and files")
                return None
            self.fd = fd
        return self.fd

    def local(self, real, dev):
        """Whether the filesystem of `real` (device `dev`) is one whose changes all raise events."""
        known = self.devs.get(dev)
        if known is None:
            import ctypes
            buf = ctypes.create_string_buffer(256)
            ok = self.libc.statfs(os.fsencode(real), buf) == 0
            f_type = ctypes.c_long.from_buffer(buf).value
            known = self.devs[dev] = ok and f_type in LOCAL_FILESYSTEMS
        return known

    def watch(self, real, dev):
        """Watch directory `real` (before it is checked: a change after this raises an event);
        whether it is watched."""
        if real in self.of:
            return True
        if len(self.of) >= self.limit or self.open() is None or not self.local(real, dev):
            return False
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(real), WATCH_MASK)
        if wd < 0 or self.wds.get(wd, real) != real:
            # (the same directory by a second path: not trusted)
            return False
        self.wds[wd], self.of[real] = real, wd
        return True

    def drain(self):
        """Take the events queued since the last walk: what they touch is no longer known."""
        if self.fd is None:
            return
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            at = 0
            while at + 16 <= len(data):
                wd, mask, _, size = struct.unpack_from("iIII", data, at)
                name = data[at + 16:at + 16 + size].rstrip(b"\0")
                at += 16 + size
                self.generation += 1
                self.event(wd, mask, os.fsdecode(name))

    def event(self, wd, mask, name):
        """What one event (of watch `wd`, about entry `name` or the directory itself) undoes."""
        if mask & IN_Q_OVERFLOW:
            self.forget("/")
            return
        d = self.wds.get(wd)
        if d is None:
            return
        if mask & IN_GONE:
            self.forget(d)
            return
        self.quiet.discard(d)
        if name:
            at = child_prefix(d) + name
            if name == ".gitignore":
                # what the directories below list may change, with no event there
                self.quiet.clear()
            elif mask & (IN_CREATE | IN_MOVED_TO) and (mask & IN_ISDIR or not self.alone(at)):
                # a hard link to a file kept here, maybe (or made in a new directory, not watched
                # yet): changes through it raise no event for that file
                self.quiet.clear()
            if mask & IN_ISDIR and mask & (IN_DELETE | IN_MOVED_FROM):
                self.forget(at)
        if mask & IN_ENTRIES or not name:
            self.clean.pop(d, None)

    @staticmethod
    def alone(path):
        """Whether `path` is there with no other hard link (else, or gone, it may have been one)."""
        try:
            return os.lstat(path).st_nlink == 1
        except OSError:
            return False

    def forget(self, top):
        """Unwatch `top` and every directory below it."""
        inside = child_prefix(top)
        for d in [d for d in self.of if d == top or d.startswith(inside)]:
            wd = self.of.pop(d)
            del self.wds[wd]
            self.clean.pop(d, None)
            self.quiet.discard(d)
            self.libc.inotify_rm_watch(self.fd, wd)

    def close(self):
        """Unwatch everything (the descriptor closed)."""
        if self.fd is not None:
            os.close(self.fd)
        self.fd, self.broken = None, True
        self.wds, self.of, self.clean, self.quiet = {}, {}, {}, set()

    def file_watched(self, path):
        """Whether the directory holding `path` is watched (so what is read of it now can be
        vouched for)."""
        return (path[:path.rfind("/")] or "/") in self.of


Visit = namedtuple("Visit", "dev ino mtime ctime outer names inner only listed kinds inos")
Visit.__doc__ = """A directory's listing as a WalkCache keeps it, one for every walk of it
(Walker.expand() picks what each finds): its device, inode, mtime and ctime in ns, the
ignore stacks outside and inside it, the names of .git and .gitignore it holds (what the
inner stack came from), the name_key of the walk that listed only the files its name_ok
passes (None: all), and the entries the ignore rules and the policy let through, in a few
bytes each where tuples of paths took two hundred: their names joined by NULs (which no
name holds), a kind each (FILE, DIR, or a LINK, whose target is looked at each time),
their inodes."""
FILE, DIR, LINK = "f", "d", "l"


class WalkCache:
    """What a warm search helper remembers of the trees it walked, each thing kept while
    it is unchanged: the ignore files it read (the same inode, size, mtime and ctime: an
    unchanged .gitignore is read and compiled once, at most IGNORE_CACHE_FILES kept) and
    the walker's visits of directories (listing(), remember(): at most
    LISTING_CACHE_ENTRIES entries in all), the least recently used going first. With
    `watch` (a warm helper's), directories walked twice are watched (Watches), and
    refresh() before each job takes what changed since."""

    def __init__(self, watch=False):
        # (base, source) -> (stat key, IgnoreFile or None)
        self.files = OrderedDict()
        self.listings = OrderedDict()              # visit key -> Visit
        self.held = 0                              # entries the listings hold
        self.watches = Watches() if watch else None
        # a glob job -> (generation, outer ignore stack, its batches, ...)
        self.results = OrderedDict()

    def refresh(self):
        """Take the changes the watches saw since the last job."""
        if self.watches is not None:
            self.watches.drain()

    def close(self):
        """Stop watching (its descriptor closed); what it keeps is checked by stat from then on."""
        if self.watches is not None:
            self.watches.close()
            self.watches = None

    def listing(self, key, real, ino, ign, inner_of, name_key):
        """The Visit remembered under `key` when it still holds: it lists all files or those
        of the walk's `name_key`, the directory is the same inode (the one its parent
        listed), with the same mtime and ctime, under the same ignore stack `ign`, and its
        own ignore rules (inner_of(names of .git and .gitignore it holds)) are the ones it
        had; else None.
        A directory watched and clean since is not looked at; one not yet watched is,
        after its watch is set."""
        seen = self.listings.get(key)
        if seen is None or seen.only not in (None, name_key):
            return None
        w, at = self.watches, (seen.mtime, seen.ctime)
        if not (w is not None and ino == seen.ino and w.clean.get(real) == at):
            watched = w is not None and w.watch(real, seen.dev)
            try:
                now = os.lstat(real)
            except OSError:
                return None
            if (now.st_ino, now.st_mtime_ns, now.st_ctime_ns) != (seen.ino,) + at \
                    or ino is not None and now.st_ino != ino:
                return None
            if watched:
                w.clean[real] = at
        if (not same_objects(seen.outer, ign)
                or not same_objects(seen.inner, inner_of(seen.names))):
            return None
        self.listings.move_to_end(key)
        return seen

    def watch_listed(self, real, fd, st):
        """Watch a directory just listed through `fd` (its stat before the listing: `st`):
        whether the watch covers what was listed (the stat unchanged once it is set)."""
        if self.watches is None or not self.watches.watch(real, st.st_dev):
            return False
        now = os.fstat(fd)
        return (now.st_mtime_ns, now.st_ctime_ns) == (st.st_mtime_ns, st.st_ctime_ns)

    def remember(self, key, visit, watched=False):
        """Keep a Visit (see listing()), unless the directory changed too lately to tell a
        change in the same clock tick from none (LISTING_RACY_S); `watched`: its watch was
        set before it was listed, or is known to cover the listing (watch_listed)."""
        if time.time() - visit.mtime / 1e9 < LISTING_RACY_S:
            return
        old = self.listings.pop(key, None)
        if old is not None:
            self.held -= len(old.kinds) + 1
        if watched:
            # (key[0]: the directory)
            self.watches.clean[key[0]] = (visit.mtime, visit.ctime)
        self.listings[key] = visit
        self.held += len(visit.kinds) + 1
        while self.held > LISTING_CACHE_ENTRIES and self.listings:
            _, dropped = self.listings.popitem(last=False)
            self.held -= len(dropped.kinds) + 1

    def read(self, base, source):
        """The rules of `source` for directory `base` (read_ignore's), from the cache when
        unchanged."""
        try:
            st = os.stat(source)
        except OSError:
            self.files.pop((base, source), None)
            return None  # no such file (or unreadable): no rules from it
        key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        seen = self.files.get((base, source))
        if seen is not None and seen[0] == key:
            self.files.move_to_end((base, source))
            return seen[1]
        rules = read_ignore(base, source)
        self.files[(base, source)] = (key, rules)
        while len(self.files) > IGNORE_CACHE_FILES:
            self.files.popitem(last=False)
        return rules

    def of_dir(self, directory):
        """The IgnoreFile of directory's .gitignore, or None."""
        return self.read(directory, os.path.join(directory, ".gitignore"))

    def excludes(self, top):
        """The ignore stack a work tree starts with: its .git/info/exclude, if any."""
        ex = self.read(top, os.path.join(top, ".git", "info", "exclude"))
        return [ex] if ex else []

    def outer(self, root):
        """.gitignore rules that apply to `root` from its work tree's top down to it
        (and .git/info/exclude). Outside a git work tree, those of every directory above
        it: projects copied into containers usually arrive without their .git, and their
        .gitignore still says what is build output (ripgrep's --no-require-git)."""
        top = git_top(root)
        stack = self.excludes(top) if top is not None else []
        top = top or "/"
        d = top
        rel = root[len(top):].strip("/")
        for part in [p for p in rel.split("/") if p]:
            rules = self.of_dir(d)
            if rules:
                stack.append(rules)
            d = os.path.join(d, part)
        return stack


# -- the walker -----------------------------------------------------------------

O_SCAN = os.O_RDONLY | os.O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC


class Walker:
    """Iterate (path, real, is_dir, inode) under `root` (a canonical directory), depth
    first (is_dir None: a symlink found as itself, with raw_links). `path` is what the
    user sees (through followed links), `real` the canonical path that was checked and
    is opened.

    Prunes .git and node_modules, honours .gitignore inside a git work tree, drops
    what the path policy denies (judged by the real path, also below followed links),
    and yields only files whose name passes `name_ok` (directories are walked whatever
    their name). Each directory is opened without following a link and must be the
    inode its parent listed, so a directory swapped for a symlink mid-walk is skipped.
    Followed directory symlinks are visited after the real tree, once per (dev, inode),
    so cycles end and a tree reached both ways is listed under its real path (or,
    reached by links only, under the link path that sorts first)."""

    def __init__(self, root, policy, follow_links, cache=None):
        self.root, self.policy, self.follow_links = root, policy, follow_links
        # a warm helper's: what it walked before, kept while unchanged
        self.cache = cache or WalkCache()
        # only(): a file name filter, and what it stands for
        self.name_ok, self.name_key = None, None
        # True: each directory's entries by name (a stable page order)
        self.ordered = False
        # True: directories are found too
        self.want_dirs = False
        self.max_depth = None
        self.seen = set()
        # (path, n, (path, real, ignore stack, depth)): entered by path once the real tree is done
        self.link_heap = []
        self.links_queued = 0
        # False: .gitignore rules are not applied (grep's no_ignore)
        self.ignores = True
        self.use_ignore = False
        # directories answered from the cache
        self.recalled = 0
        # a list: the directories visited are added to it
        self.visited = None
        # a list: ((link() arguments), its entries) of each link met
        self.links_seen = None
        # called after each directory listed
        self.tick = None
        # True: a symlink is found as itself, is_dir None (checkpoints)
        self.raw_links = False
        # True: directories are watched from the first walk, not the second (checkpoints walk
        # the same tree again and again)
        self.watch_first = False
        # False: listings are not kept in the cache (checkpoints keep theirs)
        self.remember = True
        # a directory this is true of is found, not entered
        self.prune = lambda real: False
        # a set: the directories below the root met holding a .git (whose ignore rules start
        # over there)
        self.repos = None
        # (i, n): deal() keeps slice i of n
        self.slice = None
        # directories every slice visits (deal())
        self.shared = set()

    def __iter__(self):
        return self.walk([self.start()])

    def only(self, name_ok, name_key):
        """Find only the files whose name passes name_ok; name_key says what it tests (a
        listing of only those serves the walks with the same key)."""
        self.name_ok, self.name_key = name_ok, name_key
        return self

    def start(self):
        """The root's pending entry (path, real, ignore stack, depth, inode)."""
        self.use_ignore = self.ignores
        self.shared = {self.root}
        return self.root, self.root, self.cache.outer(self.root), 0, None

    def walk(self, pending):
        """Depth first from the pending entries, then the followed links."""
        pending = list(pending)
        while pending or self.link_heap:
            if not pending:                          # (a tree linked twice: under the first name)
                entry = self.enter_link(*heapq.heappop(self.link_heap)[2])
                if entry is not None:
                    pending.append(entry)
                    if self.want_dirs:
                        yield entry[0], entry[1], True, entry[4]
                continue
            entry = pending.pop()
            found, subdirs = self.visit(*entry)
            if self.slice is not None and entry[0] in self.shared:
                found, subdirs = self.deal(entry[3], found, subdirs)
            yield from found
            pending += reversed(subdirs)
            if self.tick is not None:
                self.tick()

    def deal(self, depth, found, subdirs):
        """A shared directory's (found, subdirs) as slice i of n keeps them. Every slice
        visits the root, its children and the children of a directory with fewer than
        SLICE_FANOUT subdirectories (a chain such as src/main/java): slice 0 finds what they
        hold. Below them each subdirectory is walked by one slice, by a hash of its path,
        so that the slices agree without a word between them."""
        i, n = self.slice
        if depth == 0 or len(subdirs) < SLICE_FANOUT:
            self.shared.update(sub[0] for sub in subdirs)
        else:
            subdirs = [sub for sub in subdirs if crc32(os.fsencode(sub[0])) % n == i]
        return found if i == 0 else [], subdirs

    def scan(self, real, ino):
        """(fd, entries, stat) of a directory that is still the inode its parent listed."""
        try:
            fd = os.open(real, O_SCAN) if ino is not None else open_dir(real, flags=O_SCAN)
        except OSError:
            return None, [], None
        try:
            st = os.fstat(fd)
            if ino is not None and st.st_ino != ino:
                raise OSError                   # another directory stands there now: not it
            if self.follow_links:
                self.seen.add((st.st_dev, st.st_ino))
            with os.scandir(fd) as it:
                entries = list(it)
        except OSError:
            os.close(fd)
            return None, [], None
        if self.ordered:
            entries.sort(key=attrgetter("name"))
        return fd, entries, st

    def rules(self, path, names, ign):
        """The ignore stack inside `path`, whose entries include `names` (of .git and
        .gitignore): a nested repository (a .git of its own) starts over with its own
        exclude file; a .gitignore adds its rules."""
        if not self.use_ignore:
            return ign
        if ".git" in names and path != self.root:
            ign = self.cache.excludes(path)
            if self.repos is not None:
                self.repos.add(path)
        if ".gitignore" in names:
            rules = self.cache.of_dir(path)
            if rules:
                return [*ign, rules]
        return ign

    def visit(self, path, real, ign, depth, ino):
        """What one directory holds: (found, subdirs) as expand() makes them of its listing,
        from the cache when it remembers the directory unchanged (WalkCache.listing)."""
        if self.visited is not None:
            self.visited.append(real)
        key = None
        if self.remember:
            # (every walk's own choice is made of it: one listing, glob's and grep's)
            key = (real, path, self.use_ignore, self.ordered, self.policy.key)
            known = self.cache.listing(key, real, ino, ign,
                                       lambda names: self.rules(path, names, ign), self.name_key)
            if known is not None:
                self.recalled += 1
                if self.follow_links:
                    self.seen.add((known.dev, known.ino))
                return self.expand(known, path, real, depth)
        fd, entries, st = self.scan(real, ino)
        if fd is None:
            return [], []
        watched = ((self.watch_first or key is not None and self.recalled)
                   and self.cache.watch_listed(real, fd, st))
        # (the fd stays open: DT_UNKNOWN entries lstat through it)
        try:
            names = tuple(e.name for e in entries if e.name in (".git", ".gitignore"))
            inner = self.rules(path, names, ign)
            listing, settled = self.sort_out(entries, path, real, inner)
        finally:
            os.close(fd)
        visit = Visit(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, tuple(ign), names,
                      tuple(inner), self.name_ok and self.name_key, *listing)
        if key is not None and settled:
            self.cache.remember(key, visit, watched)
        elif watched and settled and time.time() - st.st_mtime >= LISTING_RACY_S:
            # (as remember() marks it)
            self.cache.watches.clean[real] = (st.st_mtime_ns, st.st_ctime_ns)
        return self.expand(visit, path, real, depth)

    def sort_out(self, entries, path, real, ign):
        """((names joined, kinds, inodes), settled) of a directory's files (those name_ok
        passes), directories and symlinks that the ignore stack `ign` (decided for all at
        once: ignored_among) and the policy let through; sockets, fifos and devices never.
        settled: no entry went away while it was looked at (else the listing is not kept)."""
        kept, kinds, settled, name_ok = [], [], True, self.name_ok
        for e in entries:
            try:
                if e.is_file(follow_symlinks=False):          # most entries: test files first
                    if name_ok is not None and not name_ok(e.name):
                        continue
                    kinds.append(FILE)
                elif e.is_dir(follow_symlinks=False):
                    kinds.append(DIR)
                elif e.is_symlink():                          # (judged by its target: link())
                    kinds.append(LINK)
                else:
                    continue                                  # a socket, fifo or device
                kept.append(e)
            except OSError:
                settled = False                               # gone since listed: skipped
        names = [e.name for e in kept]
        hidden = set(SKIP_DIRS)
        if self.use_ignore and ign:
            for kind in (FILE, DIR):
                hidden |= ignored_among(ign, path, list(compress(names, map(kind.__eq__, kinds))),
                                        kind == DIR)
        if not self.policy.clears_below(real):     # (else no entry needs the policy's check)
            rprefix = child_prefix(real)
            hidden.update(name for name, kind in zip(names, kinds)
                          if kind != LINK and self.policy.is_denied(rprefix + name))
        ok = [name not in hidden for name in names]
        return ("\0".join(compress(names, ok)), "".join(compress(kinds, ok)),
                array("Q", [e.inode() for e in compress(kept, ok)])), settled

    def expand(self, visit, path, real, depth):
        """(found, subdirs) of a directory's listing for this walk. found: (path, real,
        is_dir, inode) of the files that pass name_ok, of directories when want_dirs, of
        what symlinks name (link(); themselves with raw_links), in the listing's order;
        subdirs: the pending entries of directories to walk (within max_depth, not pruned).
        Most listings are of files and directories only, their paths made in C (map, zip,
        compress): a repeated walk is mostly this."""
        names = visit.listed.split("\0") if visit.listed else []
        kinds, inos, inner, name_ok = visit.kinds, visit.inos, visit.inner, self.name_ok
        prefix, rprefix = child_prefix(path), child_prefix(real)
        # (one string for both: half the memory)
        same = prefix == rprefix
        subdirs = []
        if DIR in kinds and self.deeper(depth):
            is_dir = list(map(DIR.__eq__, kinds))
            for name, ino in zip(compress(names, is_dir), compress(inos, is_dir)):
                shown = prefix + name
                at = shown if same else rprefix + name
                if not self.prune(at):
                    subdirs.append((shown, at, inner, depth + 1, ino))
        if LINK not in kinds and not self.want_dirs:
            if DIR in kinds:
                is_file = list(map(FILE.__eq__, kinds))
                names, inos = list(compress(names, is_file)), compress(inos, is_file)
            if name_ok is not None and visit.only is None:
                ok = list(map(name_ok, names))
                names, inos = list(compress(names, ok)), compress(inos, ok)
            shown = list(map(prefix.__add__, names))
            return list(zip(shown, shown if same else map(rprefix.__add__, names), repeat(False),
                            inos)), subdirs
        found = []
        for name, kind, ino in zip(names, kinds, inos):
            shown = prefix + name
            at = shown if same else rprefix + name
            if kind == FILE:
                if name_ok is None or name_ok(name):
                    found.append((shown, at, False, ino))
            elif kind == DIR:
                if self.want_dirs:
                    found.append((shown, at, True, ino))
            elif not self.raw_links:
                found += self.link(shown, at, name, inner, depth)
            elif not self.hidden(inner, shown, at, name, False):
                found.append((shown, at, None, ino))
        return found, subdirs

    def hidden(self, ign, path, real, name, is_dir):
        """Whether an ignore rule (of the stack `ign`, when the walk uses them) or the path
        policy hides this entry."""
        return bool(self.use_ignore and ign and ignored_among(
            ign, path[:len(path) - len(name) - 1] or "/", [name], is_dir)) \
            or self.policy.is_denied(real)

    def link(self, path, at, name, ign, depth):
        """A symlink's entries for visit() (resolve_link()), added to links_seen when kept."""
        found = self.resolve_link(path, at, name, ign, depth)
        if self.links_seen is not None:
            self.links_seen.append(((path, at, name, ign, depth), found))
        return found

    def resolve_link(self, path, at, name, ign, depth):
        """A symlink's entries: its target is resolved and checked by its real path; a
        directory it names is entered later (follow_links) or listed."""
        try:
            target = canonical(at)
            st = os.stat(target)
        except OSError:
            return ()  # broken or looping links are skipped
        is_dir = stat.S_ISDIR(st.st_mode)
        if self.hidden(ign, path, target, name, is_dir):
            return ()
        if is_dir and self.slice is not None and (
                target.startswith(child_prefix(self.root))
                or self.slice[0] and path[:-len(name) - 1] in self.shared):
            return ()     # a slice of the tree walks it as itself, or slice 0 follows the link
        if is_dir and self.follow_links:
            if self.deeper(depth):
                self.links_queued += 1
                entry = (path, target, ign, depth + 1)
                heapq.heappush(self.link_heap, (path, self.links_queued, entry))
            return ()
        if is_dir:
            return ()  # a directory link not followed is not listed either
        if stat.S_ISREG(st.st_mode) and (self.name_ok is None or self.name_ok(name)):
            return ((path, target, False, st.st_ino),)
        return ()

    def deeper(self, depth):
        """Whether the walk goes below a directory at `depth` (max_depth)."""
        return self.max_depth is None or depth + 1 < self.max_depth

    def enter_link(self, path, real, ign, depth):
        """The pending entry of a followed directory link, or None when seen before."""
        try:
            st = os.stat(real)
        except OSError:
            return None  # a broken link target: not entered
        if (st.st_dev, st.st_ino) in self.seen:
            return None
        self.seen.add((st.st_dev, st.st_ino))
        return path, real, ign, depth, st.st_ino


# -- the grep engine -----------------------------------------------------------------

REGEX_HINTS = ((r"\\p\{L\}|\\pL", r"[^\W\d_]"), (r"\\p\{N\}|\\pN|\\p\{Nd\}", r"\d"),
               (r"\\P\{L\}", r"[\W\d_]"),
               (r"\\p\{", r"an explicit class such as [a-z] or [^\W\d_]"),
               (r"\\x\{[0-9a-fA-F]+\}", r"\uXXXX (or \U0001XXXX)"), (r"\\z", r"\Z"),
               (r"\\[<>]", r"\b"), (r"\(\?<[a-zA-Z]", r"(?P<name>...)"), (r"\\h", r"[ \t]"))


def finder(buf):
    """contains(n, needle): whether `needle` (bytes) occurs in buf[:n], by the C library's
    memmem (several times bytearray.find's speed: it is most of a grep of big files), else
    by bytearray.find. `buf` is pinned for memmem: it can never be resized."""
    try:
        ctypes, libc = _libc()
        memmem = libc.memmem
    except (OSError, AttributeError, ImportError):
        return lambda n, needle: buf.find(needle, 0, n) >= 0
    memmem.restype = ctypes.c_void_p
    memmem.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t)
    pinned = (ctypes.c_char * len(buf)).from_buffer(buf)
    at = ctypes.addressof(pinned)
    return lambda n, needle, _pinned=pinned: memmem(at, n, needle, len(needle)) is not None


class Matcher:
    """A compiled grep pattern: a literal (bytes.find: exact on UTF-8) where it can be,
    else a regex. The regex runs on bytes for pure-ASCII text and on decoded text
    otherwise, so '.' and classes mean characters, not bytes. spans(hay, end, first_only)
    gives the (start, end) offsets of matching regions in hay[:end] (the first only, with
    first_only); in line mode at most one per line, each within a single line. Nothing
    matches at `end`: the text after a final newline is no line."""

    def __init__(self, pattern, regex=True, ignore_case=False, multiline=False):
        self.multiline = multiline
        regex = regex and not _REGEX_META.isdisjoint(pattern)  # no metacharacter: a literal
        self.literal = self.rx = self.rx_text = None
        self.folded = False
        if not regex and (not ignore_case or pattern.isascii()):
            self.literal = (pattern.lower() if ignore_case else pattern).encode("utf-8")
            # -i on ASCII: bytes.lower() and find, no regex
            self.folded, self.spans = ignore_case, self.literal_spans
        else:
            self.compile(pattern, regex, ignore_case, multiline)
            self.spans = self.regex_spans

    def compile(self, pattern, regex, ignore_case, multiline):
        """The regexes: rx_text on decoded text, and rx on bytes for pure-ASCII text
        where the pattern means the same there."""
        src = self.python_regex(pattern) if regex else re.escape(pattern)
        if not multiline:
            # '.*TODO.*' matches the lines 'TODO' does (an escaped literal has no '.*')
            src = self.drop_dot_stars(src)
        flags = re.MULTILINE | (re.IGNORECASE if ignore_case else 0) | (
            re.DOTALL if multiline else 0)
        try:
            self.rx_text = re.compile(src, flags)
        except re.error as e:
            raise ToolError(GREP_INVALID_PATTERN, "pattern %r is not a valid regular expression:"
                            " %s; escape special characters or fix the syntax (the dialect is"
                            " Python's re)" % (shorten(pattern), e))
        except (OverflowError, RecursionError, ValueError) as e:
            raise ToolError(GREP_INVALID_PATTERN,
                            "pattern %r cannot be compiled: %s" % (shorten(pattern), e))
        # \s differs between str and bytes
        if src.isascii() and not re.search(r"\\[sS]", src):
            try:
                # ASCII text: search the bytes as they are
                self.rx = re.compile(src.encode("ascii"), flags)
            except (re.error, ValueError):
                self.rx = None                                          # \u263A, \N{...}: text only

    def needs_text(self, buf, end):
        """Whether this chunk must be searched as decoded text."""
        return self.literal is None and (self.rx is None or not buf[:end].isascii())

    def literal_spans(self, hay, end, first_only):
        """spans() of a literal (bytes, so a bytes haystack): bytes.find, then on from the
        next line."""
        out, pos = [], 0
        needle, size = self.literal, len(self.literal)
        if self.folded:
            hay = hay[:end].lower()                   # same offsets: only ASCII letters change
        while True:
            i = hay.find(needle, pos, end)
            if i < 0:
                return out
            out.append((i, i + size))
            if first_only:
                return out
            j = hay.find(b"\n", i + size, end)
            if j < 0:
                return out
            pos = j + 1

    def regex_spans(self, hay, end, first_only):
        """spans() of a regex: on the bytes or the text, a match that spans lines in
        line mode retried within its first line."""
        nl, rx = ("\n", self.rx_text) if isinstance(hay, str) else (b"\n", self.rx)
        out, pos = [], 0
        phantom = hay[end - 1:end] in ("\n", b"\n", "", b"")       # nothing after a final newline
        while pos < end:
            m = rx.search(hay, pos, end)
            if m is None or (phantom and m.start() == end):
                return out
            s, e = m.span()
            if not self.multiline and hay.find(nl, s, e) >= 0:
                # spans lines: retry within its line
                s, e, pos = self.within_line(rx, hay, nl, s, end)
                if s is None:
                    continue
            out.append((s, e))
            pos = end if first_only else self.after_match(hay, nl, s, e, end)
        return out

    def after_match(self, hay, nl, s, e, end):
        """Where the search goes on after a match at s..e: at its end (multiline), or
        at the next line (line mode: one match a line); `end` past the last line."""
        if self.multiline:
            return e if e > s else e + 1
        j = hay.find(nl, e, end)
        return end if j < 0 else j + 1

    @staticmethod
    def python_regex(pattern):
        """An agent's regex in Python's dialect: POSIX classes ([[:digit:]]) translated;
        constructs of other dialects (\\p{L}, \\x{263A}, \\z, \\<word\\>, [a-z&&[^b]])
        refused with the Python spelling to use instead."""
        for other, python in REGEX_HINTS:
            m = re.search(r"(?<!\\)(?:\\\\)*(" + other + ")", pattern)
            if m:
                raise ToolError(GREP_INVALID_PATTERN, "pattern %r uses %s, which Python's re does"
                                " not know; write %s instead"
                                % (shorten(pattern), m.group(1), python))
        if re.search(r"\[[^\]]*&&", pattern):
            raise ToolError(GREP_INVALID_PATTERN, "pattern %r uses a class intersection (&&), which"
                            " Python's re does not have; list the characters ([ac-z]) or use a"
                            " lookahead ((?![b])[a-z])" % shorten(pattern))

        def posix(m):
            if m.group(1) not in POSIX_CLASSES:
                raise ToolError(GREP_INVALID_PATTERN,
                                "pattern %r uses the unknown class [:%s:]; known: %s"
                                % (shorten(pattern), m.group(1), ", ".join(sorted(POSIX_CLASSES))))
            return POSIX_CLASSES[m.group(1)]
        return re.sub(r"(?<=[\[^\w\]-])\[:(\w+):\]", posix, pattern) if "[:" in pattern else pattern

    @staticmethod
    def drop_dot_stars(src):
        """A line-mode regex without a leading or trailing '.*' (or '.*?'): in line mode
        they change no line's verdict, but make a long line quadratic to search."""
        core = re.sub(r"(?:(?<!\\)\.\*)+\Z", "", re.sub(r"\A(?:\.\*\??)+", "", src))
        return core if core and "|" not in src else src

    @staticmethod
    def within_line(rx, hay, nl, s, end):
        """A line-mode retry: the first match of rx within the line holding offset s, as
        (start, end, pos); (None, None, next line's start) when that line has none."""
        ls = hay.rfind(nl, 0, s) + 1
        le = hay.find(nl, s, end)
        le = end if le < 0 else le
        m = rx.search(hay, ls, le)
        if m is None:
            return None, None, le + 1
        return m.start(), m.end(), None


class LineRecords:
    """Content mode's records of one file, built piece by piece: (line number, is a
    match, text) for every line a match touches and every line within `before`/`after`
    lines of one, in order, with None between groups that are not adjacent (with or
    without context lines, as the original boris). `last` carries the last line shown
    from one piece to the next."""

    def __init__(self, before=0, after=0):
        self.before, self.after, self.last = before, after, None

    def add(self, hay, end, first_line, spans):
        """The records of one piece (haystack up to `end`, starting at line
        `first_line`) for its match spans."""
        nl = b"\n" if not isinstance(hay, str) else "\n"
        lines = {}                          # line number -> (start, stop, is a match line)
        for k, ls, le in self.matched_lines(hay, nl, end, first_line, spans):
            lines[k] = ls, le, True
            kb = k
            for _ in range(self.before):            # context above, up to the piece's start
                if ls == 0:
                    break
                pb = hay.rfind(nl, 0, ls - 1) + 1
                kb -= 1
                lines.setdefault(kb, (pb, ls - 1, False))
                ls = pb
            ka = k
            for _ in range(self.after):             # context below, up to its end
                if le >= end - 1:
                    break
                na = hay.find(nl, le + 1, end)
                na = end if na < 0 else na
                ka += 1
                lines.setdefault(ka, (le + 1, na, False))
                le = na
        out, prev = [], self.last
        for k in sorted(lines):
            if prev is not None and k > prev + 1:
                out.append(None)
            ls, le, is_match = lines[k]
            out.append((k, is_match, self.line_text(hay, ls, le)))
            prev = k
        self.last = prev
        return out

    @staticmethod
    def line_text(hay, start, end):
        """A line of a grep haystack as shown: decoded (undecodable bytes kept as lone
        surrogates, which scrub() turns into U+FFFD and counts), clipped."""
        text = hay[start:end]
        if not isinstance(text, str):
            # scrub() shows and counts the bad bytes
            text = bytes(text).decode("utf-8", "surrogateescape")
        return clip_line(text)

    @staticmethod
    def matched_lines(hay, nl, end, first_line, spans):
        """(line number, start, stop) of every line a match span touches (several for a
        multiline match), in order."""
        line_no, cursor = first_line, 0
        matched = []
        for s, e in spans:
            line_no += hay.count(nl, cursor, s)
            cursor = s
            pos = hay.rfind(nl, 0, s) + 1
            last = max(e - 1, s)
            k = line_no
            while True:
                le = hay.find(nl, pos, end)
                le = end if le < 0 else le
                matched.append((k, pos, le))
                if le >= last:
                    break
                pos, k = le + 1, k + 1
        return matched


# -- the outline engine ---------------------------------------------------------------
# outline's parsers, run in a search helper (where the deadline and a cancel can stop
# them). Python through `ast` (exact ranges, decorators counted); other languages
# through per-line patterns: a definition's range runs to its closing brace ("braces"),
# to the line before the next line indented as deep or shallower ("indent"; Ruby's
# `end` included), or to the next heading of its level or above ("heading"). Patterns
# look at a line's first OUTLINE_LINE_CHARS characters only, and every pattern is
# anchored and free of nested repeats, so a file costs time linear in its size.

OUTLINE_LINE_CHARS = 400                   # of a line the definition patterns look at
OUTLINE_SIGNATURE_CHARS = 120              # a definition's signature line, as shown
OUTLINE_AST_LINES = 2000                   # a longer Python file is read line by line, not by ast

OUTLINE_EXTENSIONS = {ext: lang for lang, exts in {
    "python": "py pyi pyw", "javascript": "js mjs cjs jsx", "typescript": "ts tsx mts cts",
    "go": "go", "rust": "rs", "java": "java", "kotlin": "kt kts", "csharp": "cs", "c": "c h",
    "cpp": "cc cpp cxx hh hpp hxx", "ruby": "rb", "php": "php", "shell": "sh bash zsh",
    "markdown": "md markdown", "json": "json", "yaml": "yaml yml", "toml": "toml",
}.items() for ext in exts.split()}
OUTLINE_LANGUAGES = ", ".join(sorted(set(OUTLINE_EXTENSIONS.values())))       # as a sentence lists
# not listed by a directory outline
OUTLINE_DATA = frozenset(("markdown", "json", "yaml", "toml"))
_MODS = r"(?:(?:export|default|declare|abstract|public|private|protected|internal|static|final|" \
        r"sealed|partial|async|override|virtual|readonly|open|data|inner|enum|annotation|suspend|" \
        r"inline|" \
        r"unsafe|extern|const|new|synchronized|native|strictfp|pub(?:\([\w:]+\))?)\s+)*"
_NOT_CALLS = r"(?!(?:if|for|foreach|while|switch|catch|return|new|else|throw|do|sizeof|typeof|" \
             r"await|delete|using|lock|fixed|when|with|function|super|this)\b)"
_DECL = r"^\s*" + _MODS
_JS_MEMBER = (r"^\s+" + _MODS + r"(?:get\s+|set\s+|\*\s*)?#?" + _NOT_CALLS +
              r"[A-Za-z_$][\w$]*\s*(?:<[^>()=]*>)?\s*\([^=]*$")
_JAVA_MEMBER = (r"^\s+(?:@\w+\s+)*" + _MODS + r"(?:<[^>]*>\s+)?" + _NOT_CALLS +
                r"[\w<>\[\],.?]+(?:\s+[\w<>\[\],.?]+)*\s+" + _NOT_CALLS +
                r"\w+\s*\([^=;]*(?:;?\s*|[{].*)$")
# language -> [(kind: 'class' (holds members), 'def', 'member' (only inside a
# class), 'body' (a def that counts only with a body), regex)]; Python and Ruby
# nest by indentation, the others by braces
OUTLINE_RULES = {
    "python": [("class", r"^\s*class\s+\w+"), ("def", r"^\s*(?:async\s+)?def\s+\w+")],
    "javascript": [
        ("class", _DECL + r"class\s+[\w$]+"),
        ("def", _DECL + r"function\b\s*\*?\s*[\w$]+\s*(?:<[^>]*>)?\s*\("),
        ("def", _DECL + r"(?:const|let|var)\s+[\w$]+\s*(?::[^=]+)?=\s*(?:async\s+)?"
                r"(?:function\b|(?:<[^>]*>\s*)?(?:\([^)]*\)|[\w$]+)\s*(?::\s*[^=]+)?=>)"),
        ("class", _DECL + r"(?:interface|enum|namespace|module)\s+[\w$.]+"),
        ("def", _DECL + r"type\s+[\w$]+\s*(?:<[^>]*>)?\s*="),
        ("member", _JS_MEMBER)],
    "go": [("def", r"^func\s+(?:\([^)]*\)\s*)?\w+"),
           ("class", r"^type\s+\w+\s+(?:struct|interface)\b"), ("def", r"^type\s+\w+")],
    "rust": [
        ("def", _DECL + r"(?:async\s+)?(?:const\s+)?(?:unsafe\s+)?(?:extern\s+\"[^\"]*\"\s+)?"
                r"fn\s+\w+"),
        ("class", _DECL + r"(?:struct|enum|trait|union|mod)\s+\w+"),
        ("class", _DECL + r"impl\b")],
    "java": [("class", r"^\s*(?:@\w+(?:\([^)]*\))?\s+)*" + _MODS +
                       r"(?:class|interface|enum|record|@interface)\s+\w+"),
             ("member", _JAVA_MEMBER)],
    "kotlin": [
        ("class", r"^\s*(?:@\w+\s+)*" + _MODS + r"(?:class|interface|object|enum\s+class)\s+\w+"),
        ("def", r"^\s*(?:@\w+\s+)*" + _MODS + r"fun\s+(?:<[^>]*>\s*)?[\w.]+\s*\(")],
    "csharp": [("class", r"^\s*(?:\[[^\]]*\]\s*)*" + _MODS +
                         r"(?:class|interface|struct|record|enum|namespace)\s+[\w.]+"),
               ("member", _JAVA_MEMBER)],
    "c": [("class", r"^\s*(?:typedef\s+)?(?:struct|union|enum)\s+\w+\s*\{?\s*$"),
          ("body", r"^" + _NOT_CALLS + r"(?!typedef\b|case\b|goto\b)"
                   r"(?:[A-Za-z_][\w \t\*]*?[ \t\*])?[A-Za-z_]\w*\s*\([^;=]*$")],
    "cpp": [("class", r"^\s*(?:template\s*<[^>]*>\s*)?(?:class|struct|union|enum(?:\s+class)?)"
                      r"\s+\w+[^;]*$"),
            ("class", r"^\s*namespace\s+[\w:]+\s*\{?\s*$"),
            ("body", r"^" + _NOT_CALLS + r"(?!typedef\b|case\b|goto\b)"
                     r"(?:[A-Za-z_~][\w \t\*&:<>,~]*?[ \t\*&>])?[A-Za-z_~][\w:~<>]*\s*\([^;=]*$")],
    "ruby": [("class", r"^\s*(?:class|module)\s+[\w:]+"), ("def", r"^\s*def\s+[\w.?!=]+")],
    "php": [("class", _DECL + r"(?:class|interface|trait|enum)\s+\w+"),
            ("def", _DECL + r"function\s+&?\w+")],
    "shell": [("def", r"^\s*(?:function\s+[\w.:-]+(?:\s*\(\s*\))?|[\w.:-]+\s*\(\s*\))"
                      r"\s*(?:\{.*)?$")],
}


OUTLINE_RULES["typescript"] = OUTLINE_RULES["javascript"]


_CODE_MARKS = r"[\"'`/]"                   # (compiled when a file is outlined: start-up never pays)
# a string, a comment's start, or the line's end
_CODE_TOKENS = r"\"(?:[^\"\\]|\\.)*\"?|'(?:[^'\\]|\\.)*'?|`[^`]*`?|//|/\*|\Z"


# Outline.python_lines' patterns (compiled when a file is outlined: start-up never pays)
_PY_TOKEN = r"(\"\"\"|'''|\"|')|(#)|([(\[{])|([)\]}])"
_PY_DEF = r"(?:async[ \t]+)?def[ \t]+\w|class[ \t]+\w"
_PY_SINGLE = {'"': r'(?:[^"\\]|\\.)*"', "'": r"(?:[^'\\]|\\.)*'"}


def triple_end(raw, delim, pos):
    """Where the triple-quoted string closed by `delim` ends in `raw`, searched from pos (-1: not
    on this line); a delimiter after an odd run of backslashes is escaped."""
    while True:
        k = raw.find(delim, pos)
        if k < 0:
            return -1
        if (len(raw[pos:k]) - len(raw[pos:k].rstrip("\\"))) % 2 == 0:
            return k + 3
        pos = k + 1


OutlineEntry = namedtuple("OutlineEntry", "first last depth signature")
OutlineEntry.__doc__ = """One definition of an outline: its first and last lines (from 1; a
definition's decorators are in), its depth (0: top level) and its signature as shown."""

FileOutline = namedtuple("FileOutline", "rel lang entries note lines refused")
FileOutline.__doc__ = """One file's outline, as a helper sends it (a JSON array): its path relative
to the root (None for a file root), language, entries ([OutlineEntry]), a note, its line
count, and the error code when it was not read (else None)."""


def file_outline(item):
    """A FileOutline from a helper's JSON array, its entries OutlineEntries again."""
    one = FileOutline(*item)
    return one._replace(entries=[OutlineEntry(*e) for e in one.entries])


def outline_block(one):
    """A FileOutline as a directory outline shows it: a header line, then one line per
    top-level definition."""
    note = ": " + one.note if one.note else ""
    return "\n".join(["%s (%s, %d lines)%s" % (one.rel, one.lang, one.lines, note)] +
                     outline_rows(one.entries, one.lines))


def outline_rows(entries, lines):
    """A line per definition: its range (right-aligned for a file of `lines` lines), then its
    signature indented by its depth."""
    width = 2 * len(str(max(lines, 1))) + 1
    return ["%s  %s%s" % (("%d-%d" % (e.first, e.last)).rjust(width), "  " * e.depth,
                          e.signature) for e in entries]


class OpenDefinition:
    """A definition the outline's patterns found whose end is not known yet: its index
    in Outline.entries, the brace depth (or the indentation) at its line, its kind, and
    for brace languages whether its body has opened, its parentheses still open and the
    last line of its declaration so far."""
    __slots__ = ("entry", "depth", "kind", "opened", "parens", "last")

    def __init__(self, entry, depth, kind, last):
        self.entry, self.depth, self.kind, self.last = entry, depth, kind, last
        self.opened, self.parens = False, 0


class Outline:
    """One file's outline, made by the constructor from its text and language:
    `entries` [OutlineEntry] in order, and `note`, how it was read when not by the
    language's own parser (a Python file that does not parse falls back to the patterns).
    While it is made, `stack` holds the definitions still open and `depth` the brace depth."""

    def __init__(self, text, lang):
        self.lines, self.lang, self.note = text.split("\n"), lang, ""
        self.line_count = len(self.lines) - (self.lines[-1] == "")      # a last newline ends a line
        self.entries, self.stack, self.depth = [], [], 0
        if lang == "python" and len(self.lines) > OUTLINE_AST_LINES:
            self.python_lines()
        elif lang == "python":
            try:
                self.python(text)
            except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
                why = ("line %s: %s" % (e.lineno, e.msg) if isinstance(e, SyntaxError)
                       else type(e).__name__)
                self.entries, self.note = [], "it does not parse as Python (%s), so definitions" \
                    " were found by pattern" % why
                self.patterns()
        elif lang == "markdown":
            self.headings()
        elif lang in OUTLINE_DATA:
            self.keys(text)
        else:
            self.patterns()
        self.entries = list(filter(None, self.entries))               # (end() drops some)

    @staticmethod
    def language(name):
        """The language outline reads a file of this name or path as (by its extension), or None."""
        return OUTLINE_EXTENSIONS.get(name.rsplit(".", 1)[-1].lower()) if "." in name else None

    def signature(self, k):
        """Line k (from 0) as a signature: its text stripped, joined with the lines that
        continue an unclosed parenthesis (a multi-line signature), cut at
        OUTLINE_SIGNATURE_CHARS."""
        lines = self.lines
        text, j = lines[k].strip(), k
        while (text.count("(") > text.count(")") and j < min(len(lines) - 1, k + 8)
               and lines[j + 1].strip()):
            j += 1
            text += " " + lines[j].strip()
        if text.count("(") > text.count(")"):
            text = lines[k].strip()             # no closing parenthesis near: the line alone
        elif j > k:
            text = re.sub(r"\(\s+", "(", re.sub(r",?\s+\)", ")", text))
        return (text if len(text) <= OUTLINE_SIGNATURE_CHARS
                else text[:OUTLINE_SIGNATURE_CHARS - 3] + "...")

    def python(self, text):
        """Python's definitions through ast: every def, async def and class at any depth
        (inside if, try, with and match blocks too), decorators in the range."""
        import ast
        stack = [(ast.parse(text), 0)]
        while stack:
            node, depth = stack.pop()
            statements = [c for c in ast.iter_child_nodes(node)
                          if isinstance(c, (ast.stmt, ast.excepthandler))
                          or type(c).__name__ == "match_case"]
            for child in reversed(statements):
                is_def = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                if is_def:
                    start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                    self.entries.append(OutlineEntry(start, child.end_lineno, depth,
                                                     self.signature(child.lineno - 1)))
                stack.append((child, depth + 1 if is_def else depth))
        self.entries.sort(key=lambda e: (e[0], e[2]))

    def python_lines(self):
        """Python's definitions line by line, as ast finds them but about four times as fast
        (ast builds every expression of a big file): a def or class that starts a logical line
        opens a definition, the next logical line indented as little or less closes it at the
        last line of code before it, and strings (triple-quoted ones over lines, and lines
        continued with a backslash), brackets and comments are skipped as the tokenizer does.
        It agrees with ast on every file of CPython's library (1,779 files)."""
        in_string, depth, joined, last, self.decorator = None, 0, False, -1, None
        is_def, token = re.compile(_PY_DEF), re.compile(_PY_TOKEN)
        singles = {q: re.compile(rx) for q, rx in _PY_SINGLE.items()}
        for i, raw in enumerate(self.lines):
            pos = 0
            if in_string is not None:
                last, pos = i, self.string_end(raw, in_string, singles)
                if pos < 0:
                    continue
                in_string = None
            elif depth == 0 and not joined:
                text = raw.strip()
                if text[:1] in ("", "#"):
                    continue
                self.python_statement(i, raw, text, last, is_def)
            elif not raw.strip():
                continue
            last = i
            in_string, depth = self.python_tokens(raw, pos, depth, token, singles)
            joined = in_string is None and raw.endswith("\\") and not raw.endswith("\\\\")
        self.close_to(-1, last)
        self.entries.sort(key=lambda e: (e.first, e.depth))

    @staticmethod
    def string_end(raw, quote, singles):
        """Where the string left open by the line before, by `quote`, ends in the line `raw`
        (-1: not on it)."""
        if len(quote) == 3:
            return triple_end(raw, quote, 0)
        m = singles[quote].match(raw)
        return m.end() if m else (-1 if raw.endswith("\\") else len(raw))

    def python_statement(self, i, raw, text, last, is_def):
        """A logical line that starts at line i (from 0), `text` stripped: it closes the
        definitions indented as deep or deeper at `last`, the line of code before it, and a
        def or class opens one here (from its decorators, if they are just above)."""
        indent = len(raw) - len(raw.lstrip())
        self.close_to(indent, last)
        decorator, self.decorator = self.decorator, None
        if text[0] == "@":
            self.decorator = decorator or (i, indent)
        elif is_def.match(text):
            start = decorator[0] if decorator is not None and decorator[1] == indent else i
            self.entries.append(OutlineEntry(start + 1, i + 1, len(self.stack), self.signature(i)))
            self.stack.append(OpenDefinition(len(self.entries) - 1, indent, "def", i))

    def close_to(self, indent, last):
        """Close the open definitions indented `indent` or deeper (-1: all) at line `last`
        (from 0)."""
        while self.stack and indent <= self.stack[-1].depth:
            self.close(self.stack.pop().entry, last)

    def close(self, k, last):
        """Entry k ends at line `last` (from 0)."""
        self.entries[k] = self.entries[k]._replace(last=last + 1)

    @staticmethod
    def python_tokens(raw, pos, depth, token, singles):
        """(the string left open at the end of the line or None, the bracket depth after it)
        of a line of Python from `pos` (`token`, `singles`: _PY_TOKEN, _PY_SINGLE compiled)."""
        while True:
            m = token.search(raw, pos)
            if m is None or m.group(2):
                return None, depth                       # the end, or a comment
            quote, pos = m.group(1), m.end()
            if m.group(3):
                depth += 1
            elif m.group(4):
                depth = max(depth - 1, 0)
            elif len(quote) == 3:
                pos = triple_end(raw, quote, pos)
                if pos < 0:
                    return quote, depth
            else:
                s = singles[quote].match(raw, pos)
                if s is None:
                    # continued, or unclosed
                    return (quote if raw.endswith("\\") else None), depth
                pos = s.end()

    # -- the patterns ------------------------------------------------------------
    def patterns(self):
        """The definitions the language's patterns find, nested by braces or indentation."""
        rules = [(kind, re.compile(rx)) for kind, rx in OUTLINE_RULES[self.lang]]
        if self.lang in ("python", "ruby"):
            return self.indented(rules)
        self.marks, self.tokens = re.compile(_CODE_MARKS), re.compile(_CODE_TOKENS)
        in_block = False
        for i, raw in enumerate(self.lines):
            was_in_block = in_block
            code, in_block = self.code_of(raw, in_block)
            while self.stack and not self.stack[-1].opened and self.stack[-1].parens <= 0 and not \
                    code.lstrip().startswith("{"):
                # a declaration without a body ends before this line
                self.end(self.stack.pop(), i)
            kind = None if was_in_block and not code.strip() else self.kind(
                rules, raw[:OUTLINE_LINE_CHARS])
            if kind:
                self.add(i, kind)
            self.count(i, code)
        while self.stack:                               # open at the end of the file
            self.end(self.stack.pop(), len(self.lines) - 1)

    def add(self, i, kind):
        """A definition found on line i (from 0): decorators, annotations and attributes
        above it, and a C return type on its own line, belong to it."""
        lines, start, sig = self.lines, i, self.signature(i)
        while start and re.match(r"^\s*(?:@|#\[)", lines[start - 1]):
            start -= 1
        if kind == "body" and i and re.match(r"^[A-Za-z_][\w \t\*]*$", lines[i - 1]):
            start, sig = i - 1, lines[i - 1].strip() + " " + sig
        self.entries.append(OutlineEntry(start + 1, i + 1, len(self.stack), sig))
        self.stack.append(OpenDefinition(len(self.entries) - 1, self.depth, kind, i))

    def count(self, i, code):
        """Line i's braces and parentheses: the definitions they open, and those they close."""
        peak = self.depth
        for ch in re.findall("[{}]", code):
            self.depth += 1 if ch == "{" else -1
            peak = max(peak, self.depth)
        self.depth = max(self.depth, 0)
        for entry in self.stack:
            if not entry.opened:
                entry.parens += code.count("(") - code.count(")")
                entry.last = i
        while self.stack:
            top = self.stack[-1]
            top.opened = top.opened or peak > top.depth
            if top.opened:
                ended = self.depth <= top.depth                 # its closing brace
            else:
                ended = top.parens <= 0 and code.rstrip().endswith(";")  # its ";"
            if not ended:
                break
            self.end(self.stack.pop(), i)

    def end(self, open_entry, i):
        """Close a definition at line i (from 0) if its body opened, else where its text
        ended; one that needs a body (a C function) and never opened one is dropped."""
        k = open_entry.entry
        if open_entry.opened:
            self.close(k, i)
        elif open_entry.kind == "body":
            self.entries[k] = None
        else:
            self.close(k, open_entry.last)

    def kind(self, rules, head):
        """The kind of definition `head` starts ('class', 'def', 'body'), or None; a
        'member' pattern only counts inside a class-like definition that is open."""
        inside_class = self.stack and self.stack[-1].kind == "class"
        for kind, rx in rules:
            if (kind != "member" or inside_class) and rx.match(head):
                return "def" if kind == "member" else kind
        return None

    def indented(self, rules):
        """The patterns of indented languages: a definition runs to its last line indented
        deeper than itself (Ruby: to its `end`), the last line of code before the next
        line indented as little or less."""
        last = -1
        for i, raw in enumerate(self.lines):
            head = raw[:OUTLINE_LINE_CHARS]
            text = head.strip()
            if text[:1] in ("", "#"):
                continue
            indent = len(head) - len(head.lstrip())
            ended = False
            while self.stack and indent <= self.stack[-1].depth:     # (depths only grow)
                top = self.stack.pop()
                ended = self.lang == "ruby" and indent == top.depth and re.match(r"end\b", text)
                self.close(top.entry, i if ended else last)     # (its `end` belongs to it)
            if ended:
                continue
            kind = self.kind(rules, head)
            if kind:
                start = i
                while start and self.lines[start - 1].strip().startswith("@"):
                    start -= 1                          # decorators belong to the definition
                self.entries.append(OutlineEntry(start + 1, i + 1, len(self.stack),
                                                 self.signature(i)))
                self.stack.append(OpenDefinition(len(self.entries) - 1, indent, kind, i))
            last = i
        self.close_to(-1, last)

    def code_of(self, line, in_block):
        """A line's code for counting braces: strings, character literals and comments
        removed; (code, whether a block comment is still open after it)."""
        if self.lang == "shell":
            return re.sub(r"\"(?:[^\"\\]|\\.)*\"|'[^']*'|#.*", "", line), False
        if not in_block and not self.marks.search(line):
            return line, False                  # most lines: nothing to remove
        out, i = [], 0
        while i < len(line):
            if in_block:
                j = line.find("*/", i)
                if j < 0:
                    return "".join(out), True
                in_block, i = False, j + 2
                continue
            m = self.tokens.search(line, i)
            out.append(line[i:m.start()])
            if m.group(0) == "//":
                break
            in_block, i = m.group(0) == "/*", m.end()
        return "".join(out), in_block

    # -- headings and keys ---------------------------------------------------------
    def headings(self):
        """Markdown's headings (# style, outside fenced code), each to the line before the
        next heading of its level or above."""
        fenced, found = False, []                       # (line from 0, level)
        for i, line in enumerate(self.lines):
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            m = None if fenced else re.match(r"^(#{1,6})\s+(\S.*)$", line[:OUTLINE_LINE_CHARS])
            if m:
                found.append((i, len(m.group(1))))
        top = min((level for _, level in found), default=1)
        for k, (i, level) in enumerate(found):
            nxt = next((j for j, up in found[k + 1:] if up <= level), self.line_count)
            self.entries.append(OutlineEntry(i + 1, nxt, level - top, self.signature(i)))

    def keys(self, text):
        """The keys of a JSON, YAML or TOML file's top-level object (TOML's tables too),
        each to the line before the next (a JSON object's closing brace left out)."""
        lines, lang = self.lines, self.lang
        if lang == "json":
            first = next((len(l) - len(l.lstrip()) for l in lines[1:] if l.strip().startswith('"')),
                         None)
            if first is None or len(lines) < 3:         # one line: the keys, all on it
                self.entries = self.json_keys(text)
                return
            rx = re.compile(r'^\s{%d}"((?:[^"\\]|\\.)*)"\s*:' % first)
        else:
            rx = re.compile({
                "yaml": r"^([A-Za-z_\"'][^:#]*?):(?:\s|$)",
                "toml": r"^(\[\[?[^\]]+\]\]?|[A-Za-z0-9_\"'][\w.\"' -]*?)\s*(?:=|$)"}[lang])
        starts = [i for i, line in enumerate(lines) if rx.match(line[:OUTLINE_LINE_CHARS])]
        for i, last in zip(starts, starts[1:] + [len(lines)]):
            closing = lang == "json" and last == len(lines)
            self.entries.append(OutlineEntry(i + 1, self.key_end(i + 1, last, closing), 0,
                                             self.signature(i)))

    def key_end(self, first, last, closing):
        """The last line (from 1) of a key at line `first` whose next key is after line
        `last`: blank lines before the next left out, and with `closing` (the last key of a
        JSON object) its closing brace too."""
        lines = self.lines
        while first < last and (not lines[last - 1].strip()
                                or closing and lines[last - 1].strip() == "}"):
            last -= 1
        return last

    @staticmethod
    def json_keys(text):
        """The entries of a JSON object on one line: its keys, all on line 1."""
        try:
            keys = list(json.loads(text)) if text.lstrip().startswith("{") else []
        except ValueError:
            keys = []
        return [OutlineEntry(1, 1, 0, '"%s"' % k) for k in keys[:1000]]

    # -- in a helper -----------------------------------------------------------------
    @classmethod
    def job(cls, job, emit, cache=None):
        """outline in a helper: for a file root, [its FileOutline]; for a directory, the
        FileOutline of each source file under it (gitignore-aware, as grep walks, in the
        walk's order), top-level definitions only, in batches as the walk finds them, up
        to the file that fills the page job['page'] = [offset, characters] (outline_block's
        size, as the answer counts it): a big tree is not parsed past what one answer shows.
        A file over job['max_size'] or not text is listed with a note instead."""
        real, is_dir, _ = job["root"]
        if not is_dir:
            emit([cls.of_file(real, None, job["max_size"], top=False)])
            return
        batch, (offset, room), size = [], job["page"], 0
        walker = Walker(real, PathPolicy(**job["policy"]), False, cache).only(
            lambda name: cls.language(name) not in (None,) + tuple(OUTLINE_DATA), "outline")
        walker.ordered = True
        cut = len(child_prefix(real))
        for k, (path, file_real, _, _) in enumerate(walker, 1):
            one = cls.of_file(file_real, path[cut:], job["max_size"], True)
            batch.append(one)
            if k > offset:
                size += len(outline_block(one)) + 1
                if size > room:
                    # the page is full: this file is where the answer cuts
                    break
            if len(batch) >= 50:
                emit(batch)
                batch = []
        if batch:
            emit(batch)

    @classmethod
    def of_file(cls, real, rel, max_size, top):
        """The FileOutline of one file (entries at depth 0 only when `top`)."""
        lang = cls.language(real)
        try:
            fd, st = open_regular(real, real)
            try:
                if st.st_size > max_size:
                    return FileOutline(rel, lang, [], "%s, over --max-file-size: not read"
                                       % human_size(st.st_size), 0, FILE_TOO_LARGE)
                data = read_fd(fd, max_size, real)
            finally:
                os.close(fd)
        except (ToolError, OSError) as e:
            why, code = (e.message, e.code) if isinstance(e, ToolError) else (e.strerror, IO_ERROR)
            return FileOutline(rel, lang, [], "not read: %s" % why, 0, code)
        if b"\x00" in data[:8192]:
            return FileOutline(rel, lang, [], "binary: not read", 0, INVALID_INPUT)
        text = data.decode("utf-8", "replace").replace("\r\n", "\n")
        outline = cls(text, lang)
        entries = [e for e in outline.entries if e.depth == 0] if top else outline.entries
        return FileOutline(rel, lang, entries, outline.note, outline.line_count, None)


###############################################################################
# Documents ###################################################################
###############################################################################
# -- office documents -------------------------------------------------------------
# Office documents as Markdown for view: OOXML (.docx .xlsx .pptx) and OpenDocument
# (.odt .ods .odp) are zip files of XML, read with zipfile and ElementTree in a search
# helper (the deadline and a cancel kill it). Each is taken as hostile: a part is read
# up to DOC_MEMBER_BYTES whatever its header claims (zip bombs), a part that declares a
# DTD is refused (entity tricks: these formats never have one), nesting too deep for
# the renderer is an error, a spreadsheet stops at DOC_MAX_CELLS cells.

DOC_FORMATS = {".docx": "Word document", ".docm": "Word document", ".xlsx": "Excel workbook",
               ".xlsm": "Excel workbook", ".pptx": "PowerPoint presentation",
               ".pptm": "PowerPoint presentation", ".odt": "OpenDocument text",
               ".ods": "OpenDocument spreadsheet", ".odp": "OpenDocument presentation"}
OOXML_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
OOXML_S = "{http://schemas.openxmlformats.org/spreadsheetml/2006/main}"
OOXML_P = "{http://schemas.openxmlformats.org/presentationml/2006/main}"
OOXML_A = "{http://schemas.openxmlformats.org/drawingml/2006/main}"
OOXML_R = "{http://schemas.openxmlformats.org/officeDocument/2006/relationships}"
OOXML_RELS = "{http://schemas.openxmlformats.org/package/2006/relationships}"
ODF = {k: "{urn:oasis:names:tc:opendocument:xmlns:%s:1.0}" % v for k, v in zip(
    ("text", "table", "office", "draw", "pres"),
    ("text", "table", "office", "drawing", "presentation"))}

XLSX_DATE_FORMATS = frozenset([*range(14, 23), *range(27, 37), 45, 46, 47, *range(50, 59)])


class BoundedPart:
    """A zip member read through a bound: more than DOC_MEMBER_BYTES inflated is an error
    (whatever the member's header said), and a DTD in its first bytes is refused."""

    def __init__(self, raw, name):
        self.raw, self.name, self.read_so_far = raw, name, 0
        head = raw.read(65536)
        start = re.search(rb"<[A-Za-z_]", head)
        if re.search(rb"<!DOCTYPE|<!ENTITY", head[:start.start()] if start else head, re.I) or \
                (start is None and len(head) == 65536):
            raise ToolError(INVALID_INPUT, "its part %s declares a DTD (entities), which these"
                                           " formats never have: refused" % name)
        self.head = head

    def read(self, size=-1):
        if self.head:
            data, self.head = self.head, b""
        else:
            data = self.raw.read(65536 if size is None or size < 0 else min(size, 1 << 20))
        self.read_so_far += len(data)
        if self.read_so_far > DOC_MEMBER_BYTES:
            raise ToolError(INVALID_INPUT, "its part %s inflates past %s: refused (a zip bomb?)" % (
                self.name, human_size(DOC_MEMBER_BYTES)))
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.raw.close()


def excel_date(value, epoch):
    """An Excel serial day number as an ISO date (and time, when it has one)."""
    import datetime
    try:
        days = float(value)
    except ValueError:
        return value
    if not -1e6 < days < 3e6:
        return value
    if epoch == 1900 and days < 61:
        days += 1                           # Excel's 1900-02-29, which never was
    base = datetime.datetime(1899, 12, 30) if epoch == 1900 else datetime.datetime(1904, 1, 1)
    moment = base + datetime.timedelta(days=days)
    moment = moment.replace(microsecond=0) + datetime.timedelta(
        seconds=round(moment.microsecond / 1e6))
    return moment.strftime("%Y-%m-%d" if moment.time() == datetime.time() else "%Y-%m-%d %H:%M:%S")


def without_empty_tail(items):
    """`items` (a list, changed in place) less the empty ones at its end."""
    while items and not items[-1]:
        items.pop()
    return items


def markdown_table(rows):
    """Rows of cell text as a Markdown table, the first row its header; | and line breaks
    in a cell escaped so that each row stays one line."""
    width = max([len(r) for r in rows] + [1])
    cell = lambda text: (text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "")
                         .replace("\n", "<br>") or " ")
    lines = ["| " + " | ".join(cell(c) for c in list(r) + [""] * (width - len(r))) + " |"
             for r in rows] or ["|  |"]
    return "\n".join([lines[0], "|" + "---|" * width] + lines[1:])


class Document:
    """One office document, the file object `f` of `path`, rendered by markdown() (its kind by
    the path's extension)."""

    def __init__(self, path, f):
        import zipfile
        self.kind = os.path.splitext(path)[1].lower()
        try:
            self.zip = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError,
                OverflowError) as e:
            raise ToolError(INVALID_INPUT, "not a readable %s (%s)" % (DOC_FORMATS[self.kind], e))
        self.notes = []                     # footnotes, in the order they are referred to
        self.cells = 0

    @classmethod
    def job(cls, job, emit):
        """A helper's side: [the Markdown] of the file job['path'] names (the one the server
        checked: open_checked), or a ToolError saying what is wrong."""
        import xml.etree.ElementTree as ET
        import zipfile
        import zlib
        with open_checked(job) as f:
            doc = cls(job["path"], f)
            what = DOC_FORMATS[doc.kind]
            try:
                emit([doc.markdown()])
            except RecursionError:
                raise ToolError(INVALID_INPUT, "its XML is nested too deeply to read")
            except ET.ParseError as e:
                raise ToolError(INVALID_INPUT, "a part of it is not well-formed XML (%s)" % e)
            except RuntimeError as e:                   # zipfile: an encrypted member
                raise ToolError(INVALID_INPUT, "an encrypted %s: it is not read (%s)" % (what, e))
            except (zipfile.BadZipFile, zlib.error, NotImplementedError, OSError, EOFError,
                    ValueError, KeyError, IndexError, OverflowError) as e:
                raise ToolError(INVALID_INPUT, "a damaged %s (%s: %s)" % (
                    what, type(e).__name__, e))
            finally:
                doc.zip.close()

    def markdown(self):
        """The document as Markdown, by its kind (.docx and .docm alike)."""
        by_kind = {"doc": self.docx, "xls": self.xlsx, "ppt": self.pptx}
        return by_kind.get(self.kind[1:4], self.odf)()

    # -- parts -----------------------------------------------------------------------
    def stream(self, name):
        """A part's bytes as a file object that refuses to give more than DOC_MEMBER_BYTES, its
        first bytes checked for a DTD; None when the document has no such part."""
        try:
            info = self.zip.getinfo(name)
        except KeyError:
            return None
        if info.file_size > DOC_MEMBER_BYTES:
            raise ToolError(INVALID_INPUT, "its part %s inflates to %s, over %s" % (
                name, human_size(info.file_size), human_size(DOC_MEMBER_BYTES)))
        return BoundedPart(self.zip.open(info), name)

    def xml(self, name, what=None):
        """A part parsed (an Element); None when there is none, unless the document is
        `what` ("a Word document") only with it: then an error saying it is not."""
        import xml.etree.ElementTree as ET
        part = self.stream(name)
        if part is None:
            if what:
                raise ToolError(INVALID_INPUT, "no %s: not %s" % (name, what))
            return None
        with part:
            try:
                return ET.parse(part).getroot()
            except ET.ParseError as e:
                raise ToolError(INVALID_INPUT,
                                "its part %s is not well-formed XML (%s)" % (name, e))

    def each(self, name, tag):
        """The elements `tag` of part `name`, in order; none when there is no such part."""
        root = self.xml(name)
        return root.iter(tag) if root is not None else ()

    def rels(self, name):
        """{relationship id: (part name, type)} of part `name`."""
        folder, base = posixpath.split(name)
        out = {}
        part = posixpath.join(folder, "_rels", base + ".rels")
        for rel in self.each(part, OOXML_RELS + "Relationship"):
            target = rel.get("Target", "")
            path = target.lstrip("/") if target.startswith("/") else \
                posixpath.normpath(posixpath.join(folder, target))
            out[rel.get("Id")] = (path, rel.get("Type", ""))
        return out

    @staticmethod
    def with_notes(blocks, notes):
        """Blocks as paragraphs (empty ones left out), then the footnotes [^n] they refer to."""
        return "\n\n".join(b for b in blocks if b) + "".join(
            ("\n\n" if n == 1 else "\n") + "[^%d]: %s" % (n, text)
            for n, text in enumerate(notes, 1))

    @staticmethod
    def slide(n, texts, notes):
        """A slide as Markdown: a heading, its paragraphs, then its speaker notes if any."""
        said = [t for t in notes if t]
        return "\n".join(["## Slide %d" % n] + [t for t in texts if t] +
                         (["\nNotes: " + "\n".join(said)] if said else []))

    # -- Word ------------------------------------------------------------------------
    def docx(self):
        W = OOXML_W
        styles = {}
        for style in self.each("word/styles.xml", W + "style"):
            name = style.find(W + "name")
            styles[style.get(W + "styleId")] = (name.get(W + "val", "") if name is not None
                                                else "").lower()
        notes = {note.get(W + "id"): " ".join(self.docx_text(p) for p in note.iter(W + "p")).strip()
                 for note in self.each("word/footnotes.xml", W + "footnote")
                 if note.get(W + "type") in (None, "normal")}
        document = self.xml("word/document.xml", "a Word document")
        body = document.find(W + "body")
        blocks = self.docx_blocks(body if body is not None else document, styles)
        return self.with_notes(blocks, [notes.get(i, "") for i in self.notes])

    def docx_blocks(self, parent, styles):
        """Markdown blocks of a body's paragraphs and tables (content controls entered)."""
        W, out = OOXML_W, []
        for el in parent:
            if el.tag == W + "p":
                text = self.docx_text(el).strip()
                if not text:
                    continue
                found = el.find(W + "pPr/" + W + "pStyle")
                style = styles.get(found.get(W + "val"), "") if found is not None else ""
                level = re.match(r"heading (\d)|title\Z", style)       # (a title: level 1)
                depth = el.find(W + "pPr/" + W + "numPr/" + W + "ilvl")
                if level:
                    out.append("#" * int(level.group(1) or 1) + " " + text)
                elif el.find(W + "pPr/" + W + "numPr") is not None or style.startswith("list"):
                    level = int(depth.get(W + "val", 0) if depth is not None else 0)
                    out.append("  " * level + "- " + text)
                else:
                    out.append(text)
            elif el.tag == W + "tbl":
                out.append(self.docx_table(el))
            elif el.tag in (W + "sdt", W + "sdtContent", W + "customXml", W + "ins"):
                out += self.docx_blocks(el, styles)
        joined, prev = [], False                    # list items stay together
        for block in out:
            item = block.lstrip().startswith("- ")
            if item and prev:
                joined[-1] += "\n" + block
            else:
                joined.append(block)
            prev = item
        return joined

    def docx_table(self, table):
        """A table as Markdown: a cell spanning columns is followed by empty ones."""
        W, rows = OOXML_W, []
        for row in table.iter(W + "tr"):
            rows.append([])
            for cell in row.findall(W + "tc"):
                span = cell.find(W + "tcPr/" + W + "gridSpan")
                rows[-1].append(" ".join(self.docx_text(p).strip()
                                         for p in cell.iter(W + "p")).strip())
                rows[-1] += [""] * (min(int(span.get(W + "val", "1")), 64) - 1
                                    if span is not None else 0)
        return markdown_table(rows)

    def docx_text(self, p):
        """A paragraph's text: runs, tabs, breaks, footnote marks ([^n]); deleted text left out."""
        W, parts = OOXML_W, []
        marks = {W + "tab": "\t", W + "br": "\n", W + "cr": "\n"}
        for el in p.iter():
            if el.tag == W + "t":
                parts.append(el.text or "")
            elif el.tag == W + "footnoteReference":
                self.notes.append(el.get(W + "id"))
                parts.append("[^%d]" % len(self.notes))
            else:
                parts.append(marks.get(el.tag, ""))
        return "".join(parts)

    # -- Excel -----------------------------------------------------------------------
    def xlsx(self):
        import xml.etree.ElementTree as ET
        S = OOXML_S
        book = self.xml("xl/workbook.xml", "an Excel workbook")
        rels = self.rels("xl/workbook.xml")
        shared = [self.xlsx_text(si) for si in self.each("xl/sharedStrings.xml", S + "si")]
        styles = self.xml("xl/styles.xml")
        if styles is None:
            styles = book.makeelement(S + "styleSheet", {})     # none: an empty one, finds nothing
        codes = {int(f.get("numFmtId", -1)): f.get("formatCode", "")
                 for f in styles.iter(S + "numFmt")}
        dates = [self.is_date(int(xf.get("numFmtId", 0)), codes)
                 for xf in styles.findall(S + "cellXfs/*")]
        pr = book.find(S + "workbookPr")
        epoch = 1904 if pr is not None and pr.get("date1904") in ("1", "true") else 1900
        out = []
        for sheet in book.iter(S + "sheet"):
            part = self.stream(rels.get(sheet.get(OOXML_R + "id"), ("", ""))[0])
            rows = []
            if part is not None:
                with part:
                    for _, el in ET.iterparse(part):
                        if el.tag == S + "row":
                            rows.append(self.xlsx_row(el, shared, dates, epoch))
                            el.clear()
                            if self.cells > DOC_MAX_CELLS:
                                break
            out.append(self.sheet(sheet.get("name"), rows))
            if self.cells > DOC_MAX_CELLS:
                out.append("[cells past %d left out; read the rest with a script in bash]"
                           % DOC_MAX_CELLS)
                break
        return "\n\n".join(out)

    def xlsx_row(self, row, shared, dates, epoch):
        """A row's values by column ('' where a cell is empty)."""
        S, values = OOXML_S, {}
        for k, c in enumerate(row.iter(S + "c")):
            ref = re.match(r"([A-Z]+)", c.get("r", ""))     # a column's letters: base 26, A as 1
            col = k if ref is None else \
                functools.reduce(lambda n, ch: n * 26 + ord(ch) - 64, ref.group(1), 0) - 1
            kind, v, style = c.get("t", "n"), c.findtext(S + "v"), c.get("s", "0")
            if kind == "inlineStr":
                value = self.xlsx_text(c.find(S + "is")) if c.find(S + "is") is not None else ""
            elif v is None:
                continue
            elif kind == "s":
                value = shared[int(v)] if v.strip().isdigit() and int(v) < len(shared) else ""
            elif kind == "b":
                value = "TRUE" if v.strip() == "1" else "FALSE"
            elif kind == "n" and style.isdigit() and int(style) < len(dates) and dates[int(style)]:
                value = excel_date(v, epoch)
            else:
                value = v
            if col < 16384:
                values[col] = value
                self.cells += 1
        return [values.get(i, "") for i in range(max(values, default=-1) + 1)]

    @staticmethod
    def xlsx_text(si):
        """A shared or inline string: its text, then its runs' (phonetic guides, rPh, left out)."""
        return "".join(t.text or "" for r in [si] + si.findall(OOXML_S + "r")
                       for t in r.findall(OOXML_S + "t"))


    @staticmethod
    def is_date(fmt, codes):
        """Whether number format `fmt` shows a date or a time."""
        if fmt in XLSX_DATE_FORMATS:
            return True
        code = re.sub(r'"[^"]*"|\[[^\]]*\]|\\.', "", codes.get(fmt, "")).lower()
        return bool(code) and code != "general" and re.search(r"[dmyhs]", code) is not None

    def sheet(self, name, rows):
        """A sheet as a heading and a Markdown table (the first row as its header)."""
        while rows and not any(rows[-1]):
            rows.pop()
        if not rows:
            return "## %s\n\n(empty sheet)" % name
        return "## %s\n\n%s" % (name, markdown_table(rows))

    # -- PowerPoint ------------------------------------------------------------------
    def pptx(self):
        A = OOXML_A
        pres = self.xml("ppt/presentation.xml", "a PowerPoint presentation")
        rels, out = self.rels("ppt/presentation.xml"), []
        for n, sid in enumerate(pres.iter(OOXML_P + "sldId"), 1):
            path = rels.get(sid.get(OOXML_R + "id"), ("", ""))[0]
            slide, texts, said = self.xml(path), [], []
            if slide is not None:
                texts = [self.pptx_text(p) for p in slide.iter(A + "p")]
                said = [self.pptx_text(p) for target, kind in self.rels(path).values()
                        if kind.endswith("/notesSlide") for p in self.each(target, A + "p")]
            out.append(self.slide(n, texts, said))
        return "\n\n".join(out)

    @staticmethod
    def pptx_text(p):
        """A slide paragraph's text: its runs and fields, a line break as one."""
        return "".join(el.text or "" if el.tag == OOXML_A + "t" else "\n" for el in p.iter()
                       if el.tag in (OOXML_A + "t", OOXML_A + "br")).strip()

    # -- OpenDocument ----------------------------------------------------------------
    def odf(self):
        content = self.xml("content.xml", "an OpenDocument file")
        kind = {".odt": "text", ".ods": "spreadsheet", ".odp": "presentation"}[self.kind]
        doc = content.find(ODF["office"] + "body/" + ODF["office"] + kind)
        if doc is None:
            raise ToolError(INVALID_INPUT, "its content.xml has no office:%s body" % kind)
        out = []
        if self.kind == ".ods":
            for table in doc.iter(ODF["table"] + "table"):
                out.append(self.sheet(table.get(ODF["table"] + "name"),
                                      self.odf_rows(table, values=True)))
                if self.cells > DOC_MAX_CELLS:
                    out.append("[cells past %d left out]" % DOC_MAX_CELLS)
                    break
            return "\n\n".join(out)
        if self.kind == ".odp":
            for n, page in enumerate(doc.iter(ODF["draw"] + "page"), 1):
                notes = page.find(ODF["pres"] + "notes")
                out.append(self.slide(n, self.odf_blocks(page),
                                      self.odf_blocks(notes) if notes is not None else []))
            return "\n\n".join(out)
        return self.with_notes(self.odf_blocks(doc), self.notes)

    def odf_blocks(self, parent, depth=0):
        """Markdown blocks of headings, paragraphs, lists and tables below `parent` (frames
        and sections entered; tracked changes and a slide's notes, said apart, left out)."""
        T, out = ODF["text"], []
        for el in parent:
            if el.tag == T + "h":
                level = min(6, int(el.get(T + "outline-level", "1") or 1))
                out.append("#" * level + " " + self.odf_text(el).strip())
            elif el.tag == T + "p":
                out.append(self.odf_text(el).strip())
            elif el.tag == T + "list":
                items = []
                for item in el:
                    for k, block in enumerate(b for b in self.odf_blocks(item, depth + 1) if b):
                        items.append(block if block.lstrip().startswith("- ") and k
                                     else "  " * depth + "- " + block)
                out.append("\n".join(items))
            elif el.tag == ODF["table"] + "table":
                out.append(markdown_table(self.odf_rows(el)))
            elif el.tag not in (T + "tracked-changes", ODF["pres"] + "notes"):
                out += self.odf_blocks(el, depth)
        return out

    def odf_rows(self, table, values=False):
        """A table's rows of cell text (repeated rows and columns spelled out, within bounds;
        a spreadsheet's cells by their values: numbers, dates, booleans)."""
        TB, O, rows = ODF["table"], ODF["office"], []
        for row in table.iter(TB + "table-row"):
            cells = []
            for cell in row:
                if cell.tag not in (TB + "table-cell", TB + "covered-table-cell"):
                    continue
                kind = values and cell.get(O + "value-type")

                if kind in ("float", "percentage", "currency"):
                    text = cell.get(O + "value", "")
                elif kind == "date":
                    text = cell.get(O + "date-value", "").replace("T00:00:00", "").replace("T", " ")
                elif kind == "boolean":
                    text = cell.get(O + "boolean-value", "").upper()
                else:
                    text = "\n".join(self.odf_text(p) for p in cell.iter(ODF["text"] + "p")).strip()
                repeat = int(cell.get(TB + "number-columns-repeated", "1") or 1)
                cells += [text] * (min(repeat, 1024) if text else min(repeat, 16384 - len(cells)))
                self.cells += 1
            cells = without_empty_tail(cells)
            repeat = int(row.get(TB + "number-rows-repeated", "1") or 1)
            rows += [cells] * (min(repeat, 1000) if cells else min(repeat, 1))
            if self.cells > DOC_MAX_CELLS:
                break
        return without_empty_tail(rows)

    def odf_text(self, el):
        """The text of a paragraph: spans, spaces (text:s), tabs, line breaks, links;
        a footnote becomes [^n], its body noted for the end."""
        T, parts = ODF["text"], [el.text or ""]
        # (a note's citation and an annotation: left out)
        marks = {T + "tab": "\t", T + "line-break": "\n", T + "note-citation": "",
                 ODF["office"] + "annotation": ""}
        for child in el:
            tag = child.tag
            if tag == T + "s":
                parts.append(" " * min(1000, int(child.get(T + "c", "1") or 1)))
            elif tag in marks:
                parts.append(marks[tag])
            elif tag == T + "note":
                body = child.find(T + "note-body")
                self.notes.append(" ".join(self.odf_text(p).strip() for p in body.iter(T + "p"))
                                  if body is not None else "")
                parts.append("[^%d]" % len(self.notes))
            else:
                parts.append(self.odf_text(child))
            parts.append(child.tail or "")
        return "".join(parts)


# -- PDF ------------------------------------------------------------------------------
# A PDF's text, page by page, for view: the file's structure (xref tables and streams,
# object streams, incremental updates; a damaged xref rebuilt by scanning for objects),
# the filters that carry text (Flate, LZW, ASCII85, ASCIIHex, RunLength, with PNG and
# TIFF predictors), the standard security handler with an empty user password (RC4,
# AES-128, AES-256), the page tree, content streams and form XObjects, and the fonts'
# ways from codes to characters (standard encodings, Differences, an embedded Type 1
# font's own encoding, ToUnicode CMaps, CID fonts, the CJK encodings Python has codecs
# for). Glyphs are kept in the order the page draws them, joined into lines by their
# positions. Run in a search helper (deadline, cancel); everything is bounded: inflated
# bytes, nesting, forms within forms, CMap entries.

PDF_INFLATED_MAX = 256 << 20               # bytes all streams of one PDF may inflate to
# nesting of arrays and dictionaries, the page tree, forms
PDF_DEPTH_MAX = 64
PDF_PAGES_MAX = 100000
PDF_CMAP_MAX = 1 << 20                     # entries a font's CMaps and widths may expand to
PDF_TOKEN = re.compile(rb"(?:[\x00\t\n\x0c\r ]+|%[^\r\n]*)*(?:"
                       rb"(?P<num>[+-]?(?:\d+\.?\d*|\.\d+))(?![^\x00\t\n\x0c\r ()<>\[\]{}/%])"
                       rb"|/(?P<name>[^\x00\t\n\x0c\r ()<>\[\]{}/%]*)"
                       rb"|(?P<open><<|<|\[|\(|\{)|(?P<close>>>|\]|\}|\)|>)"
                       rb"|(?P<word>[^\x00\t\n\x0c\r ()<>\[\]{}/%]+))")
PDF_REF = re.compile(  # what makes a number the start of a reference: " g R" after it (one
    # white-space character a step: a run of them could be split many ways when there is no R)
    rb"(?:[\x00\t\n\x0c\r ]|%[^\r\n]*)*([+-]?\d+)(?![^\x00\t\n\x0c\r ()<>\[\]{}/%])"
    rb"(?:[\x00\t\n\x0c\r ]|%[^\r\n]*)*R(?![^\x00\t\n\x0c\r ()<>\[\]{}/%])")
PDF_STRING_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"b": b"\b", b"f": b"\f"}
PDF_LITERAL = re.compile(rb"\\([0-7]{1,3}|\r\n|.?)|[()]", re.S)    # an escape, or a parenthesis
# Adobe glyph names for what is not a letter (letters with accents and Greek are derived)
PDF_GLYPHS = (
    "space 20 exclam 21 quotedbl 22 numbersign 23 dollar 24 percent 25 ampersand 26 quotesingle 27"
    " parenleft 28 parenright 29 asterisk 2a plus 2b comma 2c hyphen 2d period 2e slash 2f zero 30"
    " one 31 two 32 three 33 four 34 five 35 six 36 seven 37 eight 38 nine 39 colon 3a semicolon 3b"
    " less 3c equal 3d greater 3e question 3f at 40 bracketleft 5b backslash 5c bracketright 5d"
    " asciicircum 5e underscore 5f grave 60 braceleft 7b bar 7c braceright 7d asciitilde 7e"
    " nbspace a0 exclamdown a1 cent a2 sterling a3 currency a4 yen a5 brokenbar a6 section a7"
    " dieresis a8 copyright a9 ordfeminine aa guillemotleft ab logicalnot ac sfthyphen ad"
    " registered ae macron af degree b0 plusminus b1 twosuperior b2 threesuperior b3 acute b4 mu b5"
    " paragraph b6 periodcentered b7 cedilla b8 onesuperior b9 ordmasculine ba guillemotright bb"
    " onequarter bc onehalf bd threequarters be questiondown bf AE c6 Eth d0 multiply d7 Oslash d8"
    " Thorn de germandbls df ae e6 eth f0 divide f7 oslash f8 thorn fe dotlessi 131 Lslash 141"
    " lslash 142 OE 152 oe 153 florin 192 dotlessj 237 circumflex 2c6 caron 2c7 breve 2d8"
    " dotaccent 2d9 ring 2da ogonek 2db tilde 2dc hungarumlaut 2dd endash 2013 emdash 2014"
    " quoteleft 2018 quoteright 2019 quotesinglbase 201a quotedblleft 201c quotedblright 201d"
    " quotedblbase 201e dagger 2020 daggerdbl 2021 bullet 2022 ellipsis 2026 perthousand 2030"
    " guilsinglleft 2039 guilsinglright 203a fraction 2044 Euro 20ac trademark 2122 minus 2212"
    " ff fb00 fi fb01 fl fb02 ffi fb03 ffl fb04 arrowleft 2190 arrowup 2191 arrowright 2192"
    " arrowdown 2193 partialdiff 2202 Delta 2206 product 220f summation 2211 radical 221a"
    " infinity 221e integral 222b approxequal 2248 notequal 2260 lessequal 2264 greaterequal 2265"
    " lozenge 25ca Omega 2126 Dcroat 110 dcroat 111 visiblespace 2423 quotereversed 201b"
    " asteriskmath 2217 circlecopyrt a9 similar 223c element 2208 negationslash 338 prime 2032"
    " nabla 2207 universal 2200 existential 2203 emptyset 2205 intersection 2229 union 222a"
    " propersubset 2282 reflexsubset 2286 propersuperset 2283 reflexsuperset 2287 logicaland 2227"
    " logicalor 2228 angbracketleft 27e8 angbracketright 27e9 angleleft 2329 angleright 232a"
    " equivalence 2261 proportional 221d arrowdblright 21d2 arrowdblleft 21d0 arrowdblboth 21d4"
    " arrowboth 2194 arrowdblup 21d1 arrowdbldown 21d3 epsilon1 3f5 phi1 3d5 theta1 3d1"
    " openbullet 25e6 circledot 2299 circlemultiply 2297 circleplus 2295 circleminus 2296"
    " owner 220b lessmuch 226a greatermuch 226b turnstileleft 22a2 turnstileright 22a3 bardbl 2016"
    " floorleft 230a floorright 230b ceilingleft 2308 ceilingright 2309 arrownortheast 2197"
    " arrowsoutheast 2198 aleph 2135 weierstrass 2118 Rfractur 211c Ifractur 2111 spade 2660"
    " heart 2661 diamond 2662 club 2663 followsorequal 2ab0 precedesequal 2aaf follows 227b"
    " precedes 227a perpendicular 22a5 latticetop 22a4 angle 2220 therefore 2234 dotmath 22c5"
    " minusplus 2213 mapsto 21a6 suchthat 220b")
PDF_STANDARD_HIGH = (  # StandardEncoding from 0xa1 ('' : no glyph)
    "exclamdown cent sterling fraction yen florin section currency quotesingle quotedblleft"
    " guillemotleft guilsinglleft guilsinglright fi fl '' endash dagger daggerdbl periodcentered ''"
    " paragraph bullet quotesinglbase quotedblbase quotedblright guillemotright ellipsis"
    " perthousand '' questiondown '' grave acute circumflex tilde macron breve dotaccent"
    " dieresis '' ring cedilla '' hungarumlaut ogonek caron emdash " + "'' " * 16 +
    "AE '' ordfeminine '' '' '' '' Lslash Oslash OE ordmasculine '' '' '' '' '' ae '' '' ''"
    " dotlessi '' '' lslash oslash oe germandbls")
PDF_ACCENTS = {"": "", "GRAVE": "grave", "ACUTE": "acute", "CIRCUMFLEX": "circumflex",
               "TILDE": "tilde", "DIAERESIS": "dieresis", "RING ABOVE": "ring",
               "CEDILLA": "cedilla", "CARON": "caron", "MACRON": "macron", "BREVE": "breve",
               "OGONEK": "ogonek", "DOT ABOVE": "dotaccent", "DOUBLE ACUTE": "hungarumlaut",
               "STROKE": "slash"}
# A CMap name's part and the codec its codes are in (CNS: none here); the first match wins:
# GBK-EUC-H is GBK
PDF_CODECS = [part.split(":") for part in (
    "UTF16:utf-16-be UCS2:utf-16-be UTF8:utf-8 UTF32:utf-32-be RKSJ:cp932 GBK:gbk GB-EUC:gb2312"
    " GBpc-EUC:gb2312 GBT:gb18030 B5:cp950 KSC:cp949 UHC:cp949 CNS: EUC-H:euc_jp"
    " EUC-V:euc_jp").split()]
# widths of codes 32-126 in two of the standard 14 fonts, for PDFs that leave /Widths out
PDF_METRICS = {
    "Helvetica": (
        "278 278 355 556 556 889 667 191 333 333 389 584 278 333 278 278 556 556 556 556 556 556 "
        "556 556 556 556 278 278 584 584 584 556 1015 667 667 722 722 667 611 778 722 278 500 667 "
        "556 833 722 778 667 778 722 667 611 722 667 944 667 667 611 278 278 278 469 556 333 556 "
        "556 500 556 556 278 556 556 222 222 500 222 833 556 556 556 556 333 500 278 556 500 722 "
        "500 500 500 334 260 334 584 "),
    "Times": (
        "250 333 408 500 500 833 778 180 333 333 500 564 250 333 250 278 500 500 500 500 500 500 "
        "500 500 500 500 278 278 564 564 564 444 921 722 667 667 722 611 556 722 722 333 389 722 "
        "611 889 722 722 556 722 667 556 611 722 722 944 722 722 611 333 278 333 469 500 333 444 "
        "500 444 500 444 333 500 500 278 278 500 278 778 500 500 500 500 333 389 278 500 500 722 "
        "500 500 444 480 200 480 541 ")}
PDF_NAMES = {}                              # glyph name -> text, filled at first use
PDF_NUMBER = (int, float)
PDF_TWO_BYTES = ((2, b"\x00\x00", b"\xff\xff"),)     # a codespace of two-byte codes, all of them


def pdf_sniff(head, name):
    """Whether a file that begins with `head` is read as a PDF: it starts with %PDF-, or, named
    .pdf, has that line (or its first objects, when a producer left the line out) in its first KB.
    """
    return head.lstrip()[:5] == b"%PDF-" or name.lower().endswith(".pdf") and (
        b"%PDF-" in head[:1024]
        or re.search(rb"\d+[\x00\t\n\x0c\r ]+\d+[\x00\t\n\x0c\r ]+obj\b", head[:1024]))


class PdfError(Exception):
    """What makes a PDF unreadable (a ToolError's message once it reaches view)."""


class PdfBomb(PdfError):
    """Streams that inflate past PDF_INFLATED_MAX: the whole file is refused, not a font or page."""

    def __init__(self):
        PdfError.__init__(self, "its streams inflate past %s: refused (a decompression bomb?)"
                          % human_size(PDF_INFLATED_MAX))


class PdfName(str):
    """A /Name (its text without the slash), apart from strings, which are bytes."""


class PdfRef(tuple):
    """An indirect reference (number, generation)."""


class PdfStream:
    """A stream object: its dictionary and its raw (undecoded, still encrypted) bytes."""
    __slots__ = ("dict", "raw")

    def __init__(self, d, raw):
        self.dict, self.raw = d, raw


def pdf_glyph(name):
    """The text of a glyph name (Adobe's names, uniXXXX, uXXXXX, ligatures as a_b);
    None if unknown."""
    if not PDF_NAMES:
        fill_pdf_names()
    known = PDF_NAMES.get(name)
    if known is not None:
        return known
    m = re.match(r"uni((?:[0-9A-F]{4})+)$", name)
    if m:
        codes = [int(m.group(1)[i:i + 4], 16) for i in range(0, len(m.group(1)), 4)]
        return "".join(chr(c) for c in codes if not 0xd800 <= c <= 0xdfff)
    m = re.match(r"u([0-9A-F]{4,6})$", name)
    if m and int(m.group(1), 16) <= 0x10ffff:
        return chr(int(m.group(1), 16))
    base = re.match(r"([^.]+)\.", name)                 # a variant (a.sc, one.oldstyle): its base
    if base:
        return pdf_glyph(base.group(1))
    parts = [pdf_glyph(p) for p in name.split("_")] if "_" in name else [None]
    return None if None in parts else "".join(parts)


def fill_pdf_names():
    """Fill PDF_NAMES: PDF_GLYPHS' names, the accented Latin and Greek letters by the
    names Unicode gives them (Aacute, ccedilla), and the letters themselves."""
    import unicodedata
    words = PDF_GLYPHS.split()
    PDF_NAMES.update((words[i], chr(int(words[i + 1], 16))) for i in range(0, len(words), 2))
    for c in map(chr, [*range(0xc0, 0x250), *range(0x391, 0x3ca)]):
        m = re.match(r"(LATIN|GREEK) (CAPITAL|SMALL) LETTER (\w+)(?: WITH (.+))?$",
                     unicodedata.name(c, ""))
        accent = PDF_ACCENTS.get(m.group(4) or "") if m else None
        if accent is not None and (m.group(1) == "GREEK" or len(m.group(3)) == 1):
            base = m.group(3).lower()
            base = base.capitalize() if m.group(2) == "CAPITAL" else base
            PDF_NAMES.setdefault(base + accent, c)
    for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz":
        PDF_NAMES[c] = c


def pdf_sfnt(data):
    """{glyph: text} of an embedded TrueType font: from its Unicode cmap subtables, else its
    post table's glyph names. Bounded; a damaged font gives what was read."""
    try:                                                      # {tag: offset} of its tables
        tables = dict(struct.unpack_from(">4s4xI4x", data, 12 + 16 * i)
                      for i in range(min(struct.unpack_from(">H", data, 4)[0], 64)))
    except struct.error:
        return {}
    texts = pdf_sfnt_names(data, tables[b"post"]) if b"post" in tables else {}
    base, subtables = tables.get(b"cmap"), []                 # the Unicode subtables, best first
    try:
        count = min(struct.unpack_from(">H", data, base + 2)[0], 64) if base is not None else 0
        for i in range(count):
            platform, encoding, offset = struct.unpack_from(">HHI", data, base + 4 + 8 * i)
            rank = {(3, 10): 0, (3, 1): 1, (0, 4): 2, (0, 3): 3}.get(
                (platform, encoding), 4 if platform == 0 else None)
            if rank is not None:
                subtables.append((rank, base + offset))
    except struct.error:
        return texts
    mapped = {}
    for _, at in sorted(subtables):
        # the best map's lowest code for a glyph
        for code, gid in sorted(pdf_sfnt_subtable(data, at).items()):
            if 0 < code < 0xd800 or 0xe000 <= code < 0x110000:
                mapped.setdefault(gid, chr(code))
    texts.update(mapped)                                      # a character map over glyph names
    return texts


def pdf_sfnt_names(data, post):
    """{glyph: text} of a TrueType font's post table (version 2, at `post`): its glyph names,
    Mac's standard 258, then the font's own; those read before any damage."""
    texts = {}
    try:
        if data[post:post + 4] != b"\0\2\0\0":                # version 2.0: glyph names
            return texts

        names = struct.unpack_from(">%dH" % struct.unpack_from(">H", data, post + 32)[0],
                                   data, post + 34)
        custom, at = [], post + 34 + 2 * len(names)
        while at < len(data) and len(custom) < 65536:
            custom.append(data[at + 1:at + 1 + data[at]].decode("latin-1"))
            at += 1 + data[at]
        for gid, index in enumerate(names):
            if 3 <= index < 258:
                texts[gid] = pdf_mac_glyph(index)
            elif 258 <= index < 258 + len(custom) and pdf_glyph(custom[index - 258]):
                texts[gid] = pdf_glyph(custom[index - 258])
    except struct.error:
        pass                                                  # names read before the damage stay
    return texts


def pdf_sfnt_subtable(data, at):
    """{code: glyph} of the cmap subtable at `at` (formats 0, 4, 6 and 12; what was read
    before any damage)."""
    table = {}
    try:
        fmt = struct.unpack_from(">H", data, at)[0]
        if fmt == 0:
            table = dict(enumerate(data[at + 6:at + 262]))
        elif fmt == 4:
            segs = struct.unpack_from(">H", data, at + 6)[0] // 2
            words = struct.unpack_from(">%dH" % (4 * segs + 1), data, at + 14)  # ends, pad, starts
            ends, starts = words[:segs], words[segs + 1:2 * segs + 1]
            deltas, ranges = words[2 * segs + 1:3 * segs + 1], words[3 * segs + 1:]
            ranges_at = at + 16 + 6 * segs
            for k, (start, end, delta, offset) in enumerate(zip(starts, ends, deltas, ranges)):
                for code in range(start, min(end, 0xfffe) + 1):
                    if offset == 0:
                        gid = (code + delta) & 0xffff
                    else:
                        spot = ranges_at + 2 * k + offset + 2 * (code - start)
                        gid = (struct.unpack_from(">H", data, spot)[0] if spot + 2 <= len(data)
                               else 0)
                        gid = (gid + delta) & 0xffff if gid else 0
                    if gid:
                        table[code] = gid
        elif fmt == 6:
            first, n = struct.unpack_from(">HH", data, at + 6)
            table = {first + k: g
                     for k, g in enumerate(struct.unpack_from(">%dH" % n, data, at + 10))}
        elif fmt == 12:
            n = struct.unpack_from(">I", data, at + 12)[0]
            for k in range(min(n, 65536)):
                lo, hi, gid = struct.unpack_from(">III", data, at + 16 + 12 * k)
                for code in range(lo, min(hi, lo + PDF_CMAP_MAX - len(table)) + 1):
                    table[code] = gid + code - lo
                if len(table) >= PDF_CMAP_MAX:
                    break
    except struct.error:
        # what was read before the damage stays
        pass
    return table


def pdf_mac_glyph(index):
    """The character of glyph `index` (3-257) in the Macintosh standard order TrueType's post
    table numbers from: ASCII, then Mac Roman's upper half, then 32 more."""
    if index < 98:
        return chr(index + 29)
    if index < 226:
        return bytes([index + 30]).decode("mac_roman")
    return ("\u0141\u0142\u0160\u0161\u017d\u017e\u00a6\u00d0\u00f0\u00dd\u00fd\u00de\u00fe\u2212"
            "\u00d7\u00b9\u00b2\u00b3\u00bd\u00bc\u00be\u20a3\u011e\u011f\u0130\u015e\u015f\u0106"
            "\u0107\u010c\u010d\u0111"[index - 226])


def pdf_encoding(name):
    """A base encoding by name: {code: text}."""
    codec = {"WinAnsiEncoding": "cp1252", "MacRomanEncoding": "mac_roman",
             "PDFDocEncoding": "latin-1"}.get(name)
    if codec:
        table = {i: bytes([i]).decode(codec, "replace") for i in range(32, 256)}
        if codec == "cp1252":                           # the codes cp1252 leaves undefined: bullets
            table.update((i, "\u2022") for i in (0x81, 0x8d, 0x8f, 0x90, 0x9d))
        return table
    table = {i: chr(i) for i in range(32, 127)}          # StandardEncoding
    table[0x27], table[0x60] = "\u2019", "\u2018"
    table.update((0xa1 + i, pdf_glyph(g))
                 for i, g in enumerate(PDF_STANDARD_HIGH.split()) if g != "''")
    return table



def pdf_text_string(value):
    """A PDF text string (the title): UTF-16 with its BOM, UTF-8 with its BOM,
    else PDFDocEncoding."""
    if not isinstance(value, bytes):
        return ""
    if value[:2] in (b"\xfe\xff", b"\xff\xfe"):
        return value.decode("utf-16", "replace")
    if value[:3] == b"\xef\xbb\xbf":
        return value[3:].decode("utf-8", "replace")
    return value.decode("latin-1")


def pdf_hex(raw):
    """The bytes of hex digits (anything else skipped; an odd last digit as if followed by 0)."""
    hexes = re.sub(rb"[^0-9A-Fa-f]", b"", raw)
    return bytes.fromhex((hexes + b"0" * (len(hexes) % 2)).decode())


class PdfParser:
    """The objects in `data` (PDF syntax: a file, a content stream, a CMap, an object
    stream's objects), parsed at an offset by obj()."""

    def __init__(self, data):
        self.data = data

    def obj(self, pos, depth=0):
        """(the object at offset pos, the offset after it)."""
        data = self.data
        m = PDF_TOKEN.match(data, pos)
        if m is None:
            raise PdfError("damaged near byte %d (an object was expected)" % pos)
        kind, end = m.lastgroup, m.end()
        if kind == "num":
            text = m.group(kind)
            if b"." in text:
                return float(text), end
            ref = PDF_REF.match(data, end)
            return (PdfRef((int(text), int(ref.group(1)))), ref.end()) if ref else (int(text), end)
        if kind == "name":
            raw = re.sub(rb"#([0-9A-Fa-f]{2})", lambda h: bytes([int(h.group(1), 16)]),
                         m.group(kind))                         # (#xx: a byte in hex)
            return PdfName(raw.decode("latin-1")), end
        if kind == "open":
            if depth > PDF_DEPTH_MAX:
                raise PdfError("objects nested too deeply")
            what = m.group(kind)
            if what == b"(":
                return self.literal(end)
            if what == b"<":
                close = data.find(b">", end)
                if close < 0:
                    raise PdfError("an unterminated hex string")
                return pdf_hex(data[end:close]), close + 1
            if what in (b"[", b"<<"):
                return self.container(what == b"<<", end, depth)
            # '{' of a PostScript function: not text
            return None, end
        # a word (true, false, null...), or a stray closing bracket (no word: None)
        return {b"true": True, b"false": False}.get(m.group("word")), end

    def container(self, is_dict, pos, depth):
        """(an array, or a dictionary when `is_dict`, the offset after it) from just after
        its opening bracket."""
        data, items = self.data, []
        while True:
            m = PDF_TOKEN.match(data, pos)
            if m is None:
                raise PdfError("an unterminated %s" % ("dictionary" if is_dict else "array"))
            if m.lastgroup == "close":
                break
            value, pos = self.obj(pos, depth + 1)
            items.append(value)
        if is_dict:                             # keys and values in pairs (a last key alone: out)
            pairs = zip(items[0::2], items[1::2])
            return {str(k): v for k, v in pairs if isinstance(k, PdfName)}, m.end()
        return items, m.end()

    def literal(self, pos):
        """(a literal string's bytes, its escapes undone,
        the offset after it) from just after its '('."""
        data, depth = self.data, 1
        for m in PDF_LITERAL.finditer(data, pos):
            depth += {b"(": 1, b")": -1}.get(m.group(), 0)
            if not depth:
                return PDF_LITERAL.sub(pdf_unescape, data[pos:m.start()]), m.end()
        return PDF_LITERAL.sub(pdf_unescape, data[pos:]), len(data)


def pdf_unescape(m):
    """A literal string's escape (PDF_LITERAL) as its byte; an escaped line break, a digit that is
    not octal and a backslash at the end are none. A parenthesis stays."""
    e = m.group(1)
    if e is None:
        return m.group()
    if e[:1].isdigit():
        return bytes([int(e, 8) & 255]) if e[0] < 56 else b""
    return b"" if e in (b"\r\n", b"\r", b"\n", b"") else PDF_STRING_ESCAPES.get(e, e)


# -- PDF: text and fonts ----------------------------------------------------------
def pdf_mul(a, b):
    """The product of two PDF matrices [a b c d e f] (a, then b)."""
    return [a[0] * b[0] + a[1] * b[2], a[0] * b[1] + a[1] * b[3],
            a[2] * b[0] + a[3] * b[2], a[2] * b[1] + a[3] * b[3],
            a[4] * b[0] + a[5] * b[2] + b[4], a[4] * b[1] + a[5] * b[3] + b[5]]


# A string drawn on a page: where it starts and ends in page space, its size there, and
# whether its font writes down a column
PdfRun = namedtuple("PdfRun", "x y end_x end_y size text vertical")


def pdf_spaced(last, run):
    """Whether `run` follows the run `last` on its line with a space between (a gap along
    last's direction of more than a tenth of their size); None when it starts a new line."""
    dx, dy = last.end_x - last.x, last.end_y - last.y
    length = (dx * dx + dy * dy) ** 0.5
    if length < 1e-6:
        dx, dy, length = (0.0, -1.0, 1.0) if run.vertical else (1.0, 0.0, 1.0)
    ux, uy = dx / length, dy / length
    gx, gy = run.x - last.end_x, run.y - last.end_y
    along, across = gx * ux + gy * uy, abs(gy * ux - gx * uy)
    h = max(run.size, last.size)
    if across < 0.6 * h and -0.6 * h < along < 40 * h:
        return along > 0.1 * h
    return None


def pdf_lines(runs):
    """PdfRuns as lines of text: a run goes on the line before it when it goes on along that
    line's direction (pdf_spaced), else it starts a new line. Lines are then put in
    reading order (pdf_reading_order); a right-to-left line whose runs run left to right
    is turned to read (pdf_bidi)."""
    lines, line, last, back, box = [], [], None, 0, None
    for run in runs:
        x, y, ex, ey, size, text, vertical = run
        # a space drawn alone starts no line; with a width, it is one
        if text.isspace():
            if line and not line[-1][-1:].isspace() and abs(ex - x) + abs(ey - y) > 0.01 * size:
                line.append(" ")
            continue
        spaced = pdf_spaced(last, run) if last is not None else False
        if spaced is None:
            lines.append(("".join(line), back, box))
            line, back, box = [], 0, None
        elif spaced and not line[-1][-1:].isspace() and not text[:1].isspace():
            line.append(" ")
        line.append(text)
        if x - ex > abs(ey - y):
            # drawn right to left: already in reading order
            back += len(text)
        x0, x1 = (x - 0.5 * size, x + 0.5 * size) if vertical else (min(x, ex), max(x, ex))
        span = (x0, x1, min(y, ey) - 0.2 * size, max(y, ey) + 0.8 * size)
        box = span if box is None else (min(box[0], span[0]), max(box[1], span[1]),
                                        min(box[2], span[2]), max(box[3], span[3]))
        last = run
    if line:
        lines.append(("".join(line), back, box))
    order = pdf_reading_order([b for _, _, b in lines])
    text = "\n".join(pdf_line(*lines[i][:2]) for i in order).strip("\n")
    return text.translate(PDF_LIGATURES)


def pdf_line(text, back):
    """A line's text, spaces collapsed; read by pdf_bidi unless `back` (the characters drawn
    right to left) is half of it or more."""
    line = " ".join(text.split())
    return pdf_bidi(line) if 2 * back < len(text) else line


def pdf_reading_order(boxes):
    """The order to read lines in, from their boxes (x0, x1, y0, y1): cut the page where a
    band crosses it with no line in it - across (rows, top first) or down (columns, left
    first), the widest such gap first - and again in each part; lines no gap divides keep
    the order they were drawn in, unless they make one column (then top first). A page of
    very many lines keeps its drawing order."""
    if not 2 <= len(boxes) <= 3000:
        return list(range(len(boxes)))
    unit = max(sorted(b[3] - b[2] for b in boxes)[len(boxes) // 2], 1.0)    # a median line's height
    out, stack = [], [list(range(len(boxes)))]
    while stack:
        group = stack.pop()
        best = pdf_widest_gap(boxes, group, unit)
        # one column (a span every line crosses; a line alone is one):
        if best is None:
            # its lines top first
            if max(boxes[i][0] for i in group) < min(boxes[i][1] for i in group):
                group.sort(key=lambda i: -boxes[i][3])
            out.extend(group)
            continue
        _, axis, cut = best
        low = [i for i in group if boxes[i][axis + 1] <= cut]
        high = [i for i in group if boxes[i][axis + 1] > cut]
        # read first: the upper part of a row cut (higher y), the left part of a column cut
        first, then = (high, low) if axis == 2 else (low, high)
        stack += [then, first]
    return out


def pdf_widest_gap(boxes, group, unit):
    """(width, axis, middle) of the widest band with no line of `group` in it: across the
    page (axis 2: y0, y1) at least half a line (`unit`) high, or down it (axis 0: x0, x1) at
    least a line high wide; of equal ones the first found; None where there is none."""
    best = None
    for axis, least in ((2, 0.5 * unit), (0, 1.0 * unit)):
        spans = sorted((boxes[i][axis], boxes[i][axis + 1]) for i in group)
        reach = spans[0][1]
        for lo, hi in spans[1:]:
            if lo - reach >= least and (best is None or lo - reach > best[0]):
                best = (lo - reach, axis, (reach + lo) / 2.0)
            reach = max(reach, hi)
    return best


PDF_RTL = re.compile("[\u0590-\u08ff\ufb1d-\ufdff\ufe70-\ufefc]")


def pdf_bidi(line):
    """A line drawn left to right in a right-to-left script, in reading order: when most of
    its letters are Hebrew or Arabic, its characters reversed, runs of Latin letters and
    digits kept as they read."""
    if not PDF_RTL.search(line):
        return line
    import unicodedata
    kinds = [unicodedata.bidirectional(c) for c in line]
    if sum(k in ("R", "AL") for k in kinds) <= kinds.count("L"):
        return line
    out, run = [], []
    for c, k in list(zip(reversed(line), reversed(kinds))) + [("", "R")]:
        if k in ("L", "EN", "AN") or run and k not in ("R", "AL", "NSM"):
            run.append(c)
            continue
        # spaces after a Latin run stay where they are
        tail = []
        while run and unicodedata.bidirectional(run[-1]) not in ("L", "EN", "AN"):
            tail.append(run.pop())
        out += run[::-1] + tail[::-1] + [c]
        run = []
    return "".join(out)


PDF_LIGATURES = dict(zip(range(0xfb00, 0xfb07), "ff fi fl ffi ffl st st".split()))    # U+FB00 on


def pdf_standard_widths(base):
    """{code: width} of the standard font the name `base` says (Times; Helvetica, or Arial
    drawn like it); {} for any other."""
    metrics = PDF_METRICS.get("Times" if "Times" in base else
                              "Helvetica" if re.search("Helvetica|Arial", base) else "", "")
    return {32 + k: int(v) / 1000.0 for k, v in enumerate(metrics.split())}


def pdf_numbered_glyph(name, code):
    """The text of `code` where its glyph name only numbers it, as a224 or G41 do (decimal or
    hex): its cp1252 character; None for any other name."""
    m = re.match(r"[A-Za-z]{1,3}([0-9A-Fa-f]{2,3})$", name)
    if m and (m.group(1).isdigit() and int(m.group(1)) == code
              or int(m.group(1), 16) == code) and code >= 32:
        return bytes([code]).decode("cp1252", "ignore") or None
    return None


class PdfFont:
    """How a font's codes become text (decode()) and how far each moves the pen."""

    def __init__(self, pdf, d):
        self.vertical, self.down, self.scale = False, 1.0, 0.001
        # the font's em in text space units of one point
        self.em = 1.0
        self.memo, self.widths, self.default, self.uni = {}, {}, 0.5, {}
        # a CJK codec; codespace ranges [(n, lo, hi)]
        self.codec, self.spans = None, []
        subtype, tounicode = pdf.entry(d, "Subtype"), pdf.entry(d, "ToUnicode")
        self.composite = subtype == "Type0"
        cmap = {}
        if isinstance(tounicode, str) and self.composite and "Identity" in tounicode:
            self.codec = "utf-16-be"                           # the codes are the characters
        if isinstance(tounicode, PdfStream):
            try:
                cmap = PdfCMap(pdf.decoded(tounicode))
                self.spans = cmap.spans
            except PdfError:                                    # (cmap stays {})
                pass
        if self.composite:
            self.composite_font(pdf, d, cmap)
        else:
            self.simple_font(pdf, d, subtype, cmap)

    def composite_font(self, pdf, d, cmap):
        """A Type0 font's codes (by its encoding CMap and descendant CID font) and widths."""
        # (read through pdf.entry alone: what is no dictionary reads as an empty one)
        kid = pdf.get((pdf.entry(d, "DescendantFonts", list) or [{}])[0])
        name, cmap = self.cid_encoding(pdf, d, cmap)
        self.cid_widths(pdf, kid)
        self.spans = self.spans or PDF_TWO_BYTES
        if not cmap and self.codec is None and ("Identity" in name or not name):
            # no ToUnicode, codes that are CIDs: the embedded font's own map,
            # else the ASCII block of Adobe's CJK collections
            cmap = self.embedded(pdf, kid)
            ordering = pdf.entry(pdf.entry(kid, "CIDSystemInfo"), "Ordering")
            if not cmap and ordering in (b"Japan1", b"GB1", b"CNS1", b"Korea1"):
                cmap = {cid.to_bytes(2, "big"): chr(cid + 31) for cid in range(1, 96)}
        self.uni = cmap

    def cid_encoding(self, pdf, d, cmap):
        """A Type0 font's encoding CMap: its codespace, a CJK codec where there is no map to
        text, writing down a column or not; (its name, the map to text `cmap` made fit)."""
        enc = pdf.entry(d, "Encoding")
        name = str(enc) if isinstance(enc, str) else ""
        if isinstance(enc, PdfStream):
            name = str(pdf.entry(enc.dict, "CMapName") or "")
            try:            # (the encoding splits the codes, not ToUnicode)
                self.spans = PdfCMap(pdf.decoded(enc)).spans or self.spans
            except PdfError:
                pass
        self.vertical = name.endswith("-V")
        # two bytes a code, whatever ToUnicode's ranges say
        if isinstance(enc, str) and "Identity" in name:
            self.spans = PDF_TWO_BYTES
            cmap = {int.from_bytes(c, "big").to_bytes(2, "big"): t
                    for c, t in cmap.items() if len(c) <= 2}
        if name in ("H", "V") and not cmap:
            self.codec = "jis"                             # JIS X 0208 codes, two bytes
        if not cmap and "Identity" not in name and self.codec is None:
            self.codec = next((codec or None for part, codec in PDF_CODECS if part in name), None)
        return name, cmap

    def cid_widths(self, pdf, kid):
        """A CID font's widths: DW, DW2 and the W array ([first [w ...]] and [first last w])."""
        get = pdf.get
        self.default = pdf.entry(kid, "DW", PDF_NUMBER, 1000) / 1000.0
        dw2 = pdf.entry(kid, "DW2", list, [])
        if len(dw2) == 2 and isinstance(get(dw2[1]), PDF_NUMBER):
            # a glyph's advance down a column (w1 is negative)
            self.down = -get(dw2[1]) / 1000.0
        w = pdf.entry(kid, "W", list, [])
        i = 0
        while i + 1 < len(w) and len(self.widths) < PDF_CMAP_MAX:
            first, nxt = get(w[i]), get(w[i + 1])
            if not isinstance(first, int):
                break
            if isinstance(nxt, list):
                for k, v in enumerate(nxt):
                    if isinstance(get(v), PDF_NUMBER):
                        self.widths[first + k] = get(v) / 1000.0
                i += 2
            elif i + 2 < len(w) and isinstance(nxt, int):
                v = get(w[i + 2])
                if isinstance(v, PDF_NUMBER) and nxt - first < PDF_CMAP_MAX:
                    for c in range(first, nxt + 1):
                        self.widths[c] = v / 1000.0
                i += 3
            else:
                break

    def simple_font(self, pdf, d, subtype, cmap):
        """A simple font's codes (one byte each: its encoding, Differences, ToUnicode)
        and widths."""
        base, descriptor = self.simple_widths(pdf, d, subtype)
        enc = pdf.entry(d, "Encoding")
        differences = pdf.entry(enc, "Differences", list, [])
        name = str(enc) if isinstance(enc, str) else pdf.entry(enc, "BaseEncoding")
        table = self.base_encoding(pdf, name, subtype, base, descriptor)
        code = 0
        for item in differences:
            item = pdf.get(item)
            if isinstance(item, int):
                code = item
            elif isinstance(item, str) and 0 <= code < 256:
                text = pdf_glyph(item)
                if text is None:
                    text = pdf_numbered_glyph(item, code)
                if text is not None or code not in table:  # else unknown: the base encoding's stays
                    table[code] = text
                code += 1
        for c, text in cmap.items():
            if len(c) == 1:
                table[c[0]] = text
        self.uni = {bytes([c]): t for c, t in table.items() if t is not None}
        # control codes drawn as glyphs in this font
        self.low = any(c < 32 for c in table)
        self.spans = []

    def simple_widths(self, pdf, d, subtype):
        """A simple font's widths (FirstChar and Widths, a Type 3 font's matrix, MissingWidth, the
        standard fonts' metrics); (its BaseFont name, its descriptor)."""
        matrix = pdf.entry(d, "FontMatrix", list) if subtype == "Type3" else None
        if matrix and isinstance(pdf.get(matrix[0]), PDF_NUMBER):
            self.scale = pdf.get(matrix[0])
        first, widths = pdf.entry(d, "FirstChar", int), pdf.entry(d, "Widths", list, [])
        for k, v in enumerate(widths[:256] if first is not None else []):
            v = pdf.get(v)
            if isinstance(v, PDF_NUMBER):
                self.widths[first + k] = v * self.scale
        drawn = sorted(w for w in self.widths.values() if w > 0)
        # glyphs drawn in units of their own: an em from their widths
        if subtype == "Type3" and drawn:
            self.em = 2 * drawn[len(drawn) // 2]
        base = str(pdf.entry(d, "BaseFont") or "")
        descriptor = pdf.entry(d, "FontDescriptor", dict)        # (None: read as an empty one)
        missing = pdf.entry(descriptor, "MissingWidth", PDF_NUMBER, 0)
        if missing > 0:
            self.default = missing * self.scale
        elif "Courier" in base:
            self.default = 0.6
        if not self.widths:
            self.widths = pdf_standard_widths(base)
        return base, descriptor

    @staticmethod
    def base_encoding(pdf, name, subtype, base, descriptor):
        """{code: text} a simple font starts from: a named encoding, an embedded Type 1 font's
        own, else the standard one its kind implies (none for symbol fonts)."""
        if name in ("WinAnsiEncoding", "MacRomanEncoding", "StandardEncoding", "PDFDocEncoding"):
            return pdf_encoding(name)
        if subtype == "Type3":
            return {}
        program = pdf.entry(descriptor, "FontFile", PdfStream)
        if program:
            try:
                head = pdf.decoded(program)[:65536]
            except PdfError:
                head = b""
            if b"/Encoding StandardEncoding" not in head:
                builtin = {int(c): pdf_glyph(n.decode("latin-1"))
                           for c, n in re.findall(rb"dup\s+(\d+)\s*/(\S+)\s+put", head)
                           if int(c) < 256}
                if builtin:
                    return builtin
        return pdf_encoding("WinAnsiEncoding" if subtype == "TrueType" else "StandardEncoding") \
            if not re.search("Symbol|Dingbat", base) else {}

    @staticmethod
    def embedded(pdf, kid):
        """{2-byte code: text} of a TrueType CID font from the map inside its font program
        (through CIDToGIDMap), for fonts that come without ToUnicode."""
        program = pdf.entry(pdf.entry(kid, "FontDescriptor"), "FontFile2", PdfStream)
        if program is None:
            return {}
        try:
            texts = pdf_sfnt(pdf.decoded(program))
            mapping = pdf.entry(kid, "CIDToGIDMap", PdfStream)
            gids = pdf.decoded(mapping) if mapping else None
        except PdfError:
            return {}
        if gids is None:
            return {gid.to_bytes(2, "big"): t for gid, t in texts.items() if gid < 0x10000}
        found = ((cid, texts.get(gids[2 * cid] << 8 | gids[2 * cid + 1]))
                 for cid in range(min(len(gids) // 2, 0x10000)))
        return {cid.to_bytes(2, "big"): t for cid, t in found if t is not None}

    def decode(self, s):
        """(text, width in text space units of one point, codes, single-byte spaces, codes with no
        text) of a shown string."""
        known = self.memo.get(s)
        if known is not None:
            return known
        out = self.simple_codes(s) if not self.composite else \
            self.codec_codes(s) if self.codec is not None else self.cid_codes(s)
        if len(self.memo) < 100000:
            self.memo[s] = out
        return out

    def simple_codes(self, s):
        """decode() in a simple font: a byte a code."""
        uni, widths, default = self.uni, self.widths, self.default
        # (code 32 with no glyph name: still a space)
        parts = [uni.get(s[i:i + 1],
                         chr(s[i]) if 32 <= s[i] < 127 and not uni or s[i] == 32 else "")
                 for i in range(len(s))]
        width = sum(widths.get(b, default) for b in s)
        missing = sum(not t and (s[i] >= 32 or self.low) for i, t in enumerate(parts))
        # (a glyph with no text, a width of its own: parts words)
        return ("".join(t or (" " if widths.get(s[i], 0) > 0 else "") for i, t in enumerate(parts)),
                width, len(s), s.count(32), missing)

    def codec_codes(self, s):
        """decode() in a composite font whose codes are a CJK encoding Python has a codec for."""
        text = (b"\x1b$B" + s + b"\x1b(B").decode("iso2022_jp", "replace") \
            if self.codec == "jis" else s.decode(self.codec, "replace")
        missing = text.count("\ufffd")
        text = text.replace("\ufffd", "")
        return text, self.default * len(text), len(text), text.count(" "), missing

    def cid_codes(self, s):
        """decode() in a composite font: codes split by the codespace, mapped by ToUnicode."""
        uni, widths, default, spans = self.uni, self.widths, self.default, self.spans
        parts, width, i, missing = [], 0.0, 0, 0
        while i < len(s):
            n = min(2, len(s) - i)                      # (in no range: two bytes)
            for size, lo, hi in spans:
                c = s[i:i + size]
                if len(c) == size and all(lo[k] <= c[k] <= hi[k] for k in range(size)):
                    n = size
                    break
            c = s[i:i + n]
            i += n
            t, w = uni.get(c), widths.get(int.from_bytes(c, "big"), default)
            if t is None and n == 1:
                # a one-byte code, ToUnicode's keys two bytes
                t = uni.get(b"\x00" + c)
            missing += t is None
            # (a glyph with no text still parts words)
            parts.append(t or (" " if w > 0 else ""))
            width += w
        spaces = s.count(32) if all(n == 1 for n, _, _ in spans) else 0
        return "".join(parts), width, len(parts), spaces, missing

class PdfCMap(dict):
    """A CMap read: {code bytes: text} from ToUnicode's bfchar and bfrange (and cidchar
    and cidrange, whose numbers are characters there), and `spans`, its codespace
    [(length, lo, hi)] (an encoding CMap's), shortest codes first; bounded."""

    def __init__(self, data):
        dict.__init__(self)
        self.spans = []
        sub, tokens, pos, mode = PdfParser(data), [], 0, None
        while pos < len(data) and len(self) < PDF_CMAP_MAX:
            m = PDF_TOKEN.match(data, pos)
            if m is None:
                break
            word = m.group("word")
            if word is None:
                value, pos = sub.obj(pos)
                tokens.append(value)
                continue
            pos, pairs = m.end(), list(zip(tokens[0::2], tokens[1::2]))
            if word in (b"begincodespacerange", b"beginbfchar", b"beginbfrange", b"begincidrange",
                        b"begincidchar"):
                mode, tokens = word, []
                continue
            if word in (b"endcidrange", b"endcidchar"):
                self.cid_ranges(tokens, 3 if word == b"endcidrange" else 2)
            elif word == b"endcodespacerange":
                self.spans += [(len(lo), lo, hi) for lo, hi in pairs
                               if isinstance(lo, bytes) and isinstance(hi, bytes)
                               and 0 < len(lo) == len(hi) <= 4]
            elif word == b"endbfchar":
                self.update((src, pdf_unicode(dst)) for src, dst in pairs if isinstance(src, bytes))
            elif word == b"endbfrange":
                self.bf_ranges(tokens)
            elif mode is not None:                            # a stray word inside a block
                continue
            mode, tokens = None, []

        self.spans.sort(key=lambda s: s[0])

    def cid_ranges(self, tokens, step):
        """A cidrange's codes (lo hi first: step 3) or a cidchar's (code first: step 2)."""
        for j in range(0, len(tokens) - step + 1, step):
            lo, hi, first = tokens[j], tokens[j + step - 2], tokens[j + step - 1]
            if (isinstance(lo, bytes) and isinstance(hi, bytes) and isinstance(first, int)
                    and len(lo) == len(hi)):
                a, b = int.from_bytes(lo, "big"), int.from_bytes(hi, "big")
                for k in range(min(b - a + 1, PDF_CMAP_MAX - len(self))):
                    if 0 < first + k < 0xd800 or 0xe000 <= first + k < 0x110000:
                        self.setdefault((a + k).to_bytes(len(lo), "big"), chr(first + k))

    def bf_ranges(self, tokens):
        """A bfrange's codes: lo hi, then a first destination or a list of them."""
        for j in range(0, len(tokens) - 2, 3):
            lo, hi, dst = tokens[j:j + 3]
            if not (isinstance(lo, bytes) and isinstance(hi, bytes) and 0 < len(lo) == len(hi)):
                continue
            a, b = int.from_bytes(lo, "big"), int.from_bytes(hi, "big")
            if b - a > PDF_CMAP_MAX - len(self):              # (b < a: an empty range)
                continue
            for k in range(b - a + 1):
                src = (a + k).to_bytes(len(lo), "big")
                if isinstance(dst, list):
                    if k < len(dst):
                        self[src] = pdf_unicode(dst[k])
                elif isinstance(dst, bytes) and dst:
                    v = int.from_bytes(dst, "big") + k
                    self[src] = pdf_unicode(v.to_bytes(len(dst), "big")
                                            if v < 1 << (8 * len(dst)) else b"")


def pdf_unicode(dst):
    """A CMap destination (UTF-16BE bytes, or a glyph name) as text."""
    if isinstance(dst, str):
        return pdf_glyph(dst) or ""
    if not isinstance(dst, bytes):
        return ""
    if len(dst) % 2:
        return dst.decode("latin-1")
    return dst.decode("utf-16-be", "replace").replace("\ufffd", "")


# -- PDF: filters and decryption --------------------------------------------------
def pdf_lzw(data, room):
    """LZW-decoded bytes (early change), at most `room` + 1 of them."""
    table = [bytes([i]) for i in range(256)] + [b"", b""]
    out, prev, bits, buf, nbits = bytearray(), b"", 9, 0, 0
    for byte in data:
        buf, nbits = (buf << 8) | byte, nbits + 8
        while nbits >= bits:
            nbits -= bits
            code = (buf >> nbits) & ((1 << bits) - 1)
            buf &= (1 << nbits) - 1
            if code == 256:
                table, bits, prev = table[:258], 9, b""
                continue
            if code == 257:
                return bytes(out)
            if code < len(table):
                entry = table[code]
                if prev:
                    table.append(prev + entry[:1])
            elif prev:
                entry = prev + prev[:1]
                table.append(entry)
            else:
                return bytes(out)
            out += entry
            if len(out) > room:
                raise PdfBomb()
            prev = entry
            if len(table) + 1 >= 1 << bits and bits < 12:
                bits += 1
    return bytes(out)


def pdf_ascii85(data):
    """ASCII85-decoded bytes (to '~>')."""
    import base64
    data = re.sub(rb"[\x00\t\n\x0c\r ]", b"", data)
    if data.startswith(b"<~"):
        data = data[2:]
    data = data.split(b"~>")[0]
    try:
        return base64.a85decode(data)
    except ValueError:
        # damaged: what decodes before the first bad group
        out = bytearray()
        for group in re.findall(rb"z|[!-u]{5}", re.match(rb"(?:z|[!-u]{5})*", data).group()):
            try:
                out += base64.a85decode(group)
            except ValueError:                                # a group past 2**32
                break
        return bytes(out)


def pdf_run_length(data):
    """RunLength-decoded bytes."""
    out, i = bytearray(), 0
    while i < len(data):
        n = data[i]
        if n == 128:
            break
        if n < 128:
            out += data[i + 1:i + 2 + n]
            i += n + 2
        else:
            out += data[i + 1:i + 2] * (257 - n)
            i += 2
    return bytes(out)


def pdf_predictor(data, p):
    """Undo a PNG (10 and up) or TIFF (2) predictor of 8-bit samples."""
    colors, bpc, columns = (p.get(k) if isinstance(p.get(k), int) else n
                            for k, n in (("Colors", 1), ("BitsPerComponent", 8), ("Columns", 1)))
    bpp = max(1, colors * bpc // 8)
    row = (colors * bpc * columns + 7) // 8
    if p["Predictor"] == 2:
        if bpc != 8:
            return data
        out = bytearray(data)
        for start in range(0, len(out), row):
            for i in range(start + bpp, min(start + row, len(out))):
                out[i] = (out[i] + out[i - bpp]) & 255
        return bytes(out)
    out, prev = bytearray(), bytes(bpp) + bytearray(row)   # bpp zeros left of a row: its a, c
    for start in range(0, len(data), row + 1):
        kind, line = data[start], bytearray(bpp) + data[start + 1:start + 1 + row]
        line += bytes(len(prev) - len(line))
        for i in range(bpp, len(line)) if 1 <= kind <= 4 else ():   # Sub, Up, Average, Paeth
            a, b, c = line[i - bpp], prev[i], prev[i - bpp]          # left, up, up left
            # Paeth: of a, b, c (first on a tie) the nearest to a + b - c
            paeth = min((abs(b - c), a), (abs(a - c), b), (abs(a + b - 2 * c), c),
                        key=lambda pair: pair[0])[1] if kind == 4 else 0
            line[i] = (line[i] + (a, b, (a + b) // 2, paeth)[kind - 1]) & 255
        out += line[bpp:]
        prev = line
    return bytes(out)


PDF_PADDING = bytes.fromhex("28bf4e5e4e758a4164004e56fffa01082e2e00b6d0683e802f0ca9fe6453697a")


class PdfCrypt:
    """The standard security handler, opened with the empty user password (RC4 40-128,
    AES-128, AES-256; revisions 2 to 6): decrypt() the strings and streams of an object."""

    def __init__(self, pdf, d):
        if not isinstance(d, dict) or d.get("Filter") != "Standard":
            raise PdfError("encrypted with a security handler other than the standard one: it is"
                           " not read")
        v, r = pdf.entry(d, "V") or 0, pdf.entry(d, "R") or 0
        o, u = pdf.entry(d, "O") or b"", pdf.entry(d, "U") or b""
        cf = pdf.entry(d, "CF", dict) if v >= 4 else None      # (version 4 and up: crypt filters)
        stmf = pdf.entry(d, "StmF")                             # (it counts only beside CF)
        method = pdf.entry(pdf.entry(cf, stmf or "StdCF"), "CFM")
        self.aes = method in ("AESV2", "AESV3")
        self.identity = cf is not None and (stmf == "Identity" or method == "None")
        if r >= 5:
            self.key, self.aes = self.aes256_key(pdf, d, r, o, u), True
        else:
            self.key = self.md5_key(pdf, d, r, o, u)

    @staticmethod
    def aes256_key(pdf, d, r, o, u):
        """The file key of revisions 5 and 6 (AES-256), by the empty user or owner password."""
        if len(u) < 48:
            raise PdfError("a damaged encryption dictionary (/U)")
        # the user's, then an empty owner's
        for check, sealed, udata in ((u, "UE", b""), (o, "OE", u[:48])):
            if len(check) >= 48 and pdf_r6_hash(b"", check[32:40], r, udata) == check[:32]:
                return pdf_aes_cbc(pdf_r6_hash(b"", check[40:48], r, udata), bytes(16),
                                   (pdf.entry(d, sealed) or b"")[:32])

        raise PdfError("encrypted with a password: it is not read (only an empty password is"
                       " tried)")

    def md5_key(self, pdf, d, r, o, u):
        """The file key of revisions 2 to 4 (RC4, AES-128), by the empty user or owner password."""
        import hashlib
        first = pdf.get((pdf.entry(pdf.trailer, "ID", list) or [b""])[0])
        first = first if isinstance(first, bytes) else b""
        p = pdf.entry(d, "P") or 0
        n = (pdf.entry(d, "Length") or (128 if self.aes else 40)) // 8 if r >= 3 else 5
        n = max(5, min(16, n))

        def rehashed(key, keep):                            # revision 3 and up: MD5 50 times more
            for _ in range(50 if r >= 3 else 0):
                key = hashlib.md5(key).digest()[:keep]
            return key[:n]

        # the file key if `password` is the user's
        def user(password):
            h = hashlib.md5(password + o[:32] + (p & 0xffffffff).to_bytes(4, "little") + first)
            if r >= 4 and pdf.entry(d, "EncryptMetadata") is False:
                h.update(b"\xff\xff\xff\xff")
            key = rehashed(h.digest()[:n], n)
            if r == 2:
                return key if pdf_rc4(key, PDF_PADDING) == u[:32] else None
            check = hashlib.md5(PDF_PADDING + first).digest()
            for i in range(20):                             # (i = 0: the key itself)
                check = pdf_rc4(bytes(k ^ i for k in key), check)

            return key if check == u[:16] else None
        key = user(PDF_PADDING)
        # an empty owner password gives the user's
        if key is None:
            owner, secret = rehashed(hashlib.md5(PDF_PADDING).digest(), 16), o[:32]
            for i in (range(19, -1, -1) if r >= 3 else [0]):
                secret = pdf_rc4(bytes(k ^ i for k in owner), secret)
            key = user(secret)
        if key is None:
            raise PdfError("encrypted with a password: it is not read (only an empty password is"
                           " tried)")
        return key

    def object_key(self, ref):
        import hashlib
        if len(self.key) == 32:
            return self.key
        h = hashlib.md5(self.key + ref[0].to_bytes(4, "little")[:3]
                        + ref[1].to_bytes(4, "little")[:2] + (b"sAlT" if self.aes else b""))
        return h.digest()[:min(len(self.key) + 5, 16)]

    def data(self, key, data):
        if self.aes:
            if len(data) < 32:
                return b""
            out = pdf_aes_cbc(key, data[:16], data[16:])
            pad = sum(out[-1:])                                 # (its last byte; 0 for none)
            return out[:-pad] if 0 < pad <= 16 else out
        return pdf_rc4(key, data)

    def decrypt(self, value, ref, depth=0):
        """`value` (of object `ref`) with its strings and stream bytes decrypted."""
        if self.identity or depth > PDF_DEPTH_MAX:
            return value
        key = self.object_key(ref) if depth == 0 else ref
        if isinstance(value, bytes):
            return self.data(key, value)
        if isinstance(value, list):
            return [self.decrypt(x, key, depth + 1) for x in value]
        if isinstance(value, dict):
            return {k: self.decrypt(x, key, depth + 1) for k, x in value.items()}
        if isinstance(value, PdfStream) and value.dict.get("Type") != "XRef":     # (xrefs: never)
            return PdfStream(self.decrypt(value.dict, key, depth + 1), self.data(key, value.raw))
        return value


def pdf_rc4(key, data):
    """RC4 of data under key."""
    s, j = list(range(256)), 0
    for i in range(256):
        j = (j + s[i] + key[i % len(key)]) & 255
        s[i], s[j] = s[j], s[i]
    out, i, j = bytearray(len(data)), 0, 0
    for n, byte in enumerate(data):
        i = (i + 1) & 255
        j = (j + s[i]) & 255
        s[i], s[j] = s[j], s[i]
        out[n] = byte ^ s[(s[i] + s[j]) & 255]
    return bytes(out)


def pdf_r6_hash(password, salt, r, udata=b""):
    """The hash of revisions 5 (SHA-256) and 6 (ISO 32000-2's loop of AES and SHA-2)."""
    import hashlib
    k = hashlib.sha256(password + salt + udata).digest()
    if r < 6:
        return k
    i = 0
    while True:
        e = pdf_aes_cbc(k[:16], k[16:32], (password + k + udata) * 64, encrypt=True)
        k = (hashlib.sha256, hashlib.sha384, hashlib.sha512)[sum(e[:16]) % 3](e).digest()
        i += 1
        if i >= 64 and e[-1] <= i - 32:
            return k[:32]


@functools.lru_cache(maxsize=None)
def pdf_libcrypto():
    """The libcrypto Python's own ssl module is linked with, its AES functions typed (through
    ctypes), loaded once; None where this Python has none."""
    import ctypes
    try:
        import _ssl
        # (its symbols and those of its libcrypto)
        crypto = ctypes.CDLL(getattr(_ssl, "__file__", None))
        p, i = ctypes.c_void_p, ctypes.c_int
        crypto.EVP_CIPHER_CTX_new.restype = p
        crypto.EVP_aes_128_cbc.restype = crypto.EVP_aes_256_cbc.restype = p
        crypto.EVP_CIPHER_CTX_free.argtypes = [p]
        crypto.EVP_CipherInit_ex.argtypes = [p, p, p, ctypes.c_char_p, ctypes.c_char_p, i]
        crypto.EVP_CIPHER_CTX_set_padding.argtypes = [p, i]
        crypto.EVP_CipherUpdate.argtypes = [p, ctypes.c_char_p, ctypes.POINTER(i),
                                            ctypes.c_char_p, i]
        return crypto
    except (ImportError, OSError, AttributeError):
        return None


def pdf_aes_cbc(key, iv, data, encrypt=False):
    """AES (a 128 or 256-bit key) in CBC mode without padding, by pdf_libcrypto()."""
    import ctypes
    crypto = pdf_libcrypto()
    if crypto is None:
        raise PdfError("encrypted with AES: reading it needs the OpenSSL library this Python's"
                       " ssl module lacks")
    data = data[:len(data) - len(data) % 16]
    out, size = ctypes.create_string_buffer(len(data) + 16), ctypes.c_int(0)
    ctx = crypto.EVP_CIPHER_CTX_new()
    cipher = crypto.EVP_aes_128_cbc() if len(key) == 16 else crypto.EVP_aes_256_cbc()
    try:
        if not (ctx and crypto.EVP_CipherInit_ex(ctx, cipher, None, key, iv, int(encrypt)) == 1 and
                crypto.EVP_CIPHER_CTX_set_padding(ctx, 0) == 1 and
                crypto.EVP_CipherUpdate(ctx, out, size, data, len(data)) == 1):
            raise PdfError("AES failed in the OpenSSL library")
    finally:
        crypto.EVP_CIPHER_CTX_free(ctx)
    return out.raw[:size.value]


# -- PDF: the document and its pages ----------------------------------------------
# (Tz: percent)
PDF_TEXT_PARAMETERS = {b"Tc": "tc", b"Tw": "tw", b"Tz": "th", b"TL": "tl", b"Ts": "rise"}
# What each operator of a content stream does, given the state (a PdfText), the operator
# and its operands; one with operands it cannot take raises, and Pdf.run skips it
PDF_OPERATORS = {
    **dict.fromkeys((b"Tj", b"'", b'"', b"TJ"), lambda st, op, o: st.pdf.show(op, o, st)),
    **dict.fromkeys(PDF_TEXT_PARAMETERS, lambda st, op, o: setattr(
        st, PDF_TEXT_PARAMETERS[op], float(o[-1]) / (100.0 if op == b"Tz" else 1.0))),
    b"Td": lambda st, op, o: st.move(o[-2], o[-1]),
    b"TD": lambda st, op, o: st.move(o[-2], o[-1], leading=-o[-1]),
    b"T*": lambda st, op, o: st.move(0, -st.tl),
    b"Tm": lambda st, op, o: st.begin([float(x) for x in o[-6:]]),
    b"BT": lambda st, op, o: st.begin([1, 0, 0, 1, 0, 0]),
    b"Tf": lambda st, op, o: st.pdf.font(st, o[-2], o[-1]),
    b"cm": lambda st, op, o: setattr(st, "ctm", pdf_mul([float(x) for x in o[-6:]],
                                                       st.ctm)),
    b"q": lambda st, op, o: st.stack.append(st.saved()) if len(st.stack) < 1000 else None,
    b"Q": lambda st, op, o: st.restore(st.stack.pop()),
    b"Do": lambda st, op, o: st.pdf.form(st, o[-1])}


def pdf_other_operator(st, op, operands):
    """Any other operator of a content stream: nothing that text needs."""


class PdfText:
    """What Pdf.run keeps while it reads a content stream: the graphics state it needs (the
    transformation `ctm`, the font and its size, character and word spacing tc and tw,
    horizontal scale th, leading tl, rise, the text and line matrices tm and lm; the states
    q saved, `stack`) and what the stream was run with (the Pdf, resources, where runs go,
    how deep in forms, which forms; and the resources' fonts and xobjects, which run() sets)."""

    def __init__(self, pdf, ctm, resources, runs, depth, forms):
        self.pdf = pdf
        self.restore((ctm, None, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0))
        self.tm = self.lm = [1, 0, 0, 1, 0, 0]
        self.resources, self.runs, self.depth, self.forms = resources, runs, depth, forms
        self.stack = []

    def saved(self):
        """What q saves and Q restores."""
        return self.ctm, self.font, self.size, self.tc, self.tw, self.th, self.tl, self.rise

    def restore(self, saved):
        self.ctm, self.font, self.size, self.tc, self.tw, self.th, self.tl, self.rise = saved

    def begin(self, matrix):
        """BT and Tm: the text and the line matrix both `matrix`."""
        self.tm = self.lm = matrix

    def move(self, tx, ty, leading=None):
        """The next line, (tx, ty) from this line's start (Td, T*, ' and "; TD sets the
        `leading` too)."""
        self.tl = self.tl if leading is None else leading
        lm = self.lm
        self.lm = self.tm = lm[:4] + [lm[4] + tx * lm[0] + ty * lm[2],
                                      lm[5] + tx * lm[1] + ty * lm[3]]


class Pdf(PdfParser):
    """One PDF file's objects (`data`: its bytes): obj() parses at an offset, get() resolves a
    reference, stream() decodes a stream, pages() lists the page dictionaries with their
    inherited resources, page_text() reads one page."""

    def __init__(self, data):
        self.data, self.inflated, self.crypt, self.trailer, self.fonts = data, 0, None, {}, {}
        # number -> offset; -> (stream number, index)
        self.offsets, self.packed, self.cache = {}, {}, {}
        # number -> offset found by a scan, when needed
        self.scanned = None
        # codes shown that no map turns into text
        self.unmapped = 0
        if not pdf_sniff(data, "a.pdf"):
            raise PdfError("it does not start as a PDF does (%PDF-)")
        try:
            self.read_xref()
        except (PdfError, ValueError, IndexError, KeyError, TypeError, RecursionError):
            self.trailer = {}                                 # (and rebuild() starts afresh)

        if self.entry(self.trailer, "Root", dict) is None:
            self.rebuild()
        if "Encrypt" in self.trailer:
            self.crypt = PdfCrypt(self, self.get(self.trailer["Encrypt"]))
            # (what was read before is read again, decrypted)
            self.cache = {}

    # -- the file's structure
    def indirect(self, pos, number=None):
        """The object defined at offset pos ('n g obj ... endobj'), a stream with its raw bytes."""
        data = self.data
        m = re.compile(rb"[\x00\t\n\x0c\r ]*(\d+)[\x00\t\n\x0c\r ]+(\d+)[\x00\t\n\x0c\r ]+obj"
                       ).match(data, pos)
        if m is None or number is not None and int(m.group(1)) != number:
            raise PdfError("no object %s at byte %d" % (number, pos))
        value, pos = self.obj(m.end())

        s = re.compile(rb"[\x00\t\n\x0c\r ]*stream\r?\n?").match(data, pos)
        if s is None or not isinstance(value, dict):
            return value
        start, length = s.end(), self.get(value.get("Length"))
        end = start + length if isinstance(length, int) else -1
        if not start <= end <= len(data) or \
                not re.match(rb"[\x00\t\n\x0c\r ]*endstream", data[end:end + 32]):
            # the first endstream (else the end of the file), less the line break before it
            end = re.compile(rb"(?:\r\n|[\r\n])?(?:endstream|\Z)").search(data, start).start()
        return PdfStream(value, data[start:end])

    def read_xref(self):
        """Read the xref sections from the last startxref back through /Prev."""
        at = self.data.rfind(b"startxref")                    # (-1: none, and no match)
        m = re.match(rb"startxref\s*(\d+)", self.data[at:at + 40])
        if m is None:
            raise PdfError("no startxref with an offset")
        pos, seen = int(m.group(1)), set()
        while isinstance(pos, int) and pos not in seen and len(seen) < 1000:
            seen.add(pos)
            m = re.compile(rb"[\x00\t\n\x0c\r ]*xref").match(self.data, pos)
            if m is not None:
                trailer = self.xref_table(m.end())
                if isinstance(trailer.get("XRefStm"), int):
                    self.xref_stream(self.indirect(trailer["XRefStm"]))
            else:
                stream = self.indirect(pos)
                if not isinstance(stream, PdfStream):
                    raise PdfError("startxref points at no xref")
                trailer = self.xref_stream(stream)
            self.trailer = dict(trailer, **self.trailer)         # (the newest section's keys win)
            pos = trailer.get("Prev")

    def xref_table(self, pos):
        """One 'xref' table (the newest entry of a number
        wins: later sections were read first); its trailer."""
        data = self.data
        section = re.compile(rb"[\x00\t\n\x0c\r ]*(\d+)[ \t]+(\d+)[ \t]*\r?\n?")
        entry = re.compile(rb"[\x00\t\n\x0c\r ]*(\d{1,10})[ \t]+(\d{1,5})[ \t]+([nf])")
        while True:
            m = section.match(data, pos)
            if m is None:
                break
            first, count, pos = int(m.group(1)), int(m.group(2)), m.end()
            for i in range(count):
                e = entry.match(data, pos)
                if e is None:
                    break
                pos = e.end()
                if e.group(3) == b"n" and first + i not in self.packed:
                    self.offsets.setdefault(first + i, int(e.group(1)))
        m = re.compile(rb"[\x00\t\n\x0c\r ]*trailer").match(data, pos)
        if m is None:
            raise PdfError("an xref table without its trailer")
        trailer, _ = self.obj(m.end())
        return trailer if isinstance(trailer, dict) else {}

    def xref_stream(self, stream):
        """One cross-reference stream (/Type /XRef); its dictionary (the trailer)."""
        d = stream.dict
        data = self.decoded(stream)
        w = [x if isinstance(x, int) and 0 <= x <= 8 else 0 for x in (d.get("W") or [1, 2, 1])[:3]]
        index = d.get("Index") or [0, d.get("Size", 0)]
        size, pos = sum(w), 0
        if size == 0:
            return d
        for first, count in zip(index[0::2], index[1::2]):
            for i in range(count) if isinstance(first, int) and isinstance(count, int) else ():
                row = data[pos:pos + size]
                if len(row) < size:
                    return d
                pos += size
                f = [int.from_bytes(row[sum(w[:k]):sum(w[:k + 1])], "big") for k in range(3)]
                kind = f[0] if w[0] else 1
                n = first + i
                if n in self.offsets or n in self.packed:
                    continue
                if kind == 1:
                    self.offsets[n] = f[1]
                elif kind == 2:
                    self.packed[n] = (f[1], f[2])
        return d

    def rebuild(self):
        """A damaged or missing xref: find every 'n g obj' in the file (the last of a number wins),
        the trailers' and object streams' contents, and the catalog if no trailer names it."""
        self.offsets, self.packed, self.cache = dict(self.scan()), {}, {}
        for m in re.finditer(rb"trailer[\x00\t\n\x0c\r ]*<<", self.data):
            try:
                trailer, _ = self.obj(m.end() - 2)
            except PdfError:
                continue
            if isinstance(trailer, dict):
                self.trailer.update(trailer)
        for number in list(self.offsets):
            value = self.get(PdfRef((number, 0)))
            d = value.dict if isinstance(value, PdfStream) else value
            if not isinstance(d, dict):
                continue
            if d.get("Type") == "ObjStm" and isinstance(value, PdfStream):
                try:
                    for i, n in enumerate(self.object_stream(value)[0]):
                        self.packed.setdefault(n, (number, i))
                except (PdfError, ValueError):
                    pass
            elif d.get("Type") == "XRef":
                for key in ("Root", "Info", "Encrypt", "ID"):
                    if key in d:
                        self.trailer.setdefault(key, d[key])
        if self.entry(self.trailer, "Root", dict) is None:
            for number in self.offsets:
                value = self.get(PdfRef((number, 0)))
                if isinstance(value, dict) and value.get("Type") == "Catalog":
                    self.trailer["Root"] = PdfRef((number, 0))
                    break
            else:
                raise PdfError("no catalog (a damaged file, or not a PDF)")

    def scan(self):
        """{object number: offset} of every 'n g obj' in the file (the last of a number wins)."""
        if self.scanned is None:
            found = re.finditer(
                rb"(?<![0-9])(\d{1,10})[\x00\t\n\x0c\r ]+\d{1,5}[\x00\t\n\x0c\r ]+obj\b", self.data)
            self.scanned = {int(m.group(1)): m.start() for m in found}
        return self.scanned

    def object_stream(self, stream):
        """(the numbers, the offsets, the decoded bytes) of an object stream."""
        data = self.decoded(stream)
        n, first = stream.dict.get("N"), stream.dict.get("First")
        if not isinstance(n, int) or not isinstance(first, int):
            raise PdfError("an object stream without /N and /First")
        head = [int(x) for x in data[:first].split()[:2 * n]]
        return head[0::2], [first + o for o in head[1::2]], data

    def entry(self, d, key, kind=object, default=None):
        """Dictionary `d`'s value at `key`, resolved, when it is a `kind`; else `default`
        (that too when `d` is no dictionary)."""
        value = self.get(d.get(key)) if isinstance(d, dict) else None
        return value if isinstance(value, kind) else default

    def get(self, value, depth=0):
        """`value` with a reference resolved (None if it leads nowhere)."""
        if not isinstance(value, PdfRef):
            return value
        if value in self.cache:
            return self.cache[value]
        # (a reference to itself leads nowhere)
        self.cache[value] = None
        number, found = value[0], None
        try:
            if number in self.packed:
                holder, index = self.packed[number]
                stream = self.get(PdfRef((holder, 0)), depth + 1)
                if isinstance(stream, PdfStream) and depth < 8:
                    key = ("objstm", holder)
                    if key not in self.cache:
                        self.cache[key] = self.object_stream(stream)
                    numbers, offsets, data = self.cache[key]
                    found, _ = PdfParser(data).obj(offsets[index])      # (none: IndexError)
            elif number in self.offsets:
                try:
                    found = self.indirect(self.offsets[number], number)
                except PdfError:
                    # an xref off by some bytes: where the object is
                    if number not in self.scan():
                        raise
                    found = self.indirect(self.scanned[number], number)
                if self.crypt is not None:
                    found = self.crypt.decrypt(found, value)
        except (PdfError, ValueError, IndexError, RecursionError):
            found = None
        self.cache[value] = found
        return found

    # -- streams
    def decoded(self, stream):
        """The bytes of a stream, its filters undone (decrypted first); bounded."""
        d, data = stream.dict, stream.raw
        filters, params = self.entry(d, "Filter"), self.entry(d, "DecodeParms")
        filters = filters if isinstance(filters, list) else [filters] if filters else []
        params = params if isinstance(params, list) else [params] * len(filters)
        lzw = lambda data: pdf_lzw(data, PDF_INFLATED_MAX - self.inflated)
        hex_digits = lambda data: pdf_hex(data.split(b">")[0])      # (to the '>' ending them)
        undo = {"FlateDecode": self.inflate, "Fl": self.inflate, "LZWDecode": lzw, "LZW": lzw,
                "ASCII85Decode": pdf_ascii85, "A85": pdf_ascii85, "ASCIIHexDecode": hex_digits,
                "AHx": hex_digits, "RunLengthDecode": pdf_run_length, "RL": pdf_run_length}
        for f, p in zip(filters, params + [None] * len(filters)):
            f, p = str(self.get(f)), self.get(p)         # (str: a damaged one may be a list)
            if f == "Crypt":
                continue
            if f not in undo:
                raise PdfError("a stream in %s (an image, not text)" % f)
            data = undo[f](data)
            if isinstance(p, dict) and isinstance(p.get("Predictor"), int) and p["Predictor"] > 1:
                data = pdf_predictor(data, p)
            self.inflated += len(data)
            if self.inflated > PDF_INFLATED_MAX:
                raise PdfBomb()
        return data

    def inflate(self, data):
        """Flate data, as much as can be had of a damaged
        stream, never past what is left of the bound."""
        import zlib
        room = PDF_INFLATED_MAX - self.inflated
        best = b""
        # (then raw deflate after the 2-byte header: no checksum to fail)
        for wbits, start in ((15, 0), (-15, 2)):
            z, out, size = zlib.decompressobj(wbits), [], 0
            # (in pieces: a damaged end keeps what came before)
            for at in range(start, len(data), 1 << 16):
                try:
                    piece = z.decompress(data[at:at + (1 << 16)], room + 1 - size)
                except zlib.error:
                    break
                out.append(piece)
                size += len(piece)
                if size > room or z.unconsumed_tail:
                    raise PdfBomb()
                if z.eof:
                    break
            if size > len(best):
                best = b"".join(out)
            if z.eof:
                break
        return best

    def body(self, stream):
        """The bytes of a content stream, its filters undone; None when `stream` is not one or
        cannot be decoded (a decompression bomb is still refused)."""
        try:
            return self.decoded(stream) if isinstance(stream, PdfStream) else None
        except PdfBomb:
            raise
        except PdfError:
            return None

    def content(self, page):
        """The page's content streams, decoded and joined."""
        c = self.get(page.get("Contents"))
        parts = [self.body(self.get(part)) for part in (c if isinstance(c, list) else [c])[:10000]]
        return b"\n".join(part for part in parts if part is not None)

    # -- pages
    def pages(self):
        """[(the page dictionary, its resources)], in order, through the page tree (cycles and
        depth bounded; a tree that leads nowhere: the objects of /Type /Page, in file order)."""
        root = self.entry(self.trailer, "Root", dict, {})
        out, seen = [], set()

        def walk(node, resources, depth):
            node_ref, node = node, self.get(node)
            if not isinstance(node, dict) or depth > PDF_DEPTH_MAX or len(out) >= PDF_PAGES_MAX:
                return
            if isinstance(node_ref, PdfRef):
                if node_ref in seen:
                    return
                seen.add(node_ref)
            resources = node.get("Resources", resources)    # (inherited down the tree)
            kids = self.entry(node, "Kids", list)
            if node.get("Type") == "Page" or kids is None:
                if node.get("Type") != "Pages":
                    out.append((node, self.get(resources) or {}))
                return
            for kid in kids:
                walk(kid, resources, depth + 1)
        walk(root.get("Pages"), None, 0)
        return out

    def info(self):
        """The document's title, or ''."""
        title = self.entry(self.entry(self.trailer, "Info"), "Title")
        return " ".join(pdf_text_string(title).split())

    # -- text
    def font(self, st, name, size):
        """Tf: the state's font size, and its font, the PdfFont of resource `name` (kept by
        reference; None when there is none)."""
        st.size = float(size)
        ref = st.fonts.get(name) if isinstance(name, str) else None
        key = ref if isinstance(ref, PdfRef) else id(ref)
        if key not in self.fonts:
            self.fonts[key] = PdfFont(self, self.get(ref)) if ref is not None else None
        st.font = self.fonts[key]

    def page_text(self, page, resources):
        """The text of one page, its lines in reading order (pdf_lines), and a last line that
        counts the characters its fonts give no text for."""
        runs, self.unmapped = [], 0
        self.run(self.content(page), resources, [1, 0, 0, 1, 0, 0], runs, 0, set())
        self.annotations(page, runs)
        text = pdf_lines(runs)
        if self.unmapped:
            text += "\n[not shown: %s whose font carries no map to text]" % plural(
                self.unmapped, "character")
        return text.strip("\n")

    def field_value(self, annot, normal):
        """(the field type, the value) of a form field's widget `annot` (both inherited from its
        parents), or of a FreeText note without an appearance (`normal`)."""
        field, kind, value = annot, None, None
        for _ in range(PDF_DEPTH_MAX):
            kind = kind or self.entry(field, "FT")
            value = value if value is not None else self.entry(field, "V")
            field = self.entry(field, "Parent", dict)
            if field is None:
                break
        if annot.get("Subtype") == "FreeText" and not isinstance(normal, PdfStream):
            value, kind = self.entry(annot, "Contents"), "Tx"
        return kind, value

    def annotations(self, page, runs):
        """A page's annotations as drawn (their appearance streams), and a form field's text
        value where it has no appearance or the form asks for new ones, into `runs`."""
        annots = self.entry(page, "Annots", list, [])
        acroform = self.entry(self.entry(self.trailer, "Root"), "AcroForm")
        regenerate = self.entry(acroform, "NeedAppearances") is True
        for annot in annots[:1000]:
            # a form field's value, a note: as drawn
            annot = self.get(annot)
            if not isinstance(annot, dict) or self.entry(annot, "F", int, 0) & 2:
                continue
            normal = self.entry(self.entry(annot, "AP"), "N")
            if isinstance(normal, dict):
                normal = self.entry(normal, self.entry(annot, "AS", str))
            rect = self.entry(annot, "Rect")
            try:                                              # the lower left corner
                x, y = (min(float(self.get(rect[i])), float(self.get(rect[i + 2]))) for i in (0, 1))
            except (TypeError, ValueError, IndexError, KeyError):
                continue
            kind, value = self.field_value(annot, normal)
            if kind in ("Tx", "Ch") and isinstance(value, bytes) and (
                    regenerate or not isinstance(normal, PdfStream)):
                # the size DA gives ('/Helv 9 Tf'); none, or 0 (fit to the box): 12
                size = re.search(rb"(\d+\.?\d*|\.\d+)\s+Tf",
                                 self.entry(annot, "DA", bytes, b"") + b" 12 Tf")
                size = float(size.group(1)) or 12.0
                for k, line in enumerate(pdf_text_string(value).splitlines()):
                    runs.append(PdfRun(x, y - k * size, x + 0.5 * size * len(line),
                                       y - k * size, size, line, False))
            elif isinstance(normal, PdfStream):
                self.run(b"/ap Do", {"XObject": {"ap": normal}}, [1, 0, 0, 1, x, y], runs, 0, set())

    def run(self, data, resources, ctm, runs, depth, forms):
        """Interpret a content stream: each string shown becomes a run (x, y, end x, end y,
        size, text) in page space; form XObjects are run inside it."""
        st = PdfText(self, ctm, resources, runs, depth, forms)
        st.fonts = self.entry(resources, "Font", dict, {})
        st.xobjects = self.entry(resources, "XObject", dict, {})

        operands = []
        pos, end = 0, len(data)
        match = PDF_TOKEN.match
        sub = PdfParser(data)
        while pos < end:
            m = match(data, pos)
            if m is None:
                break
            kind = m.lastgroup
            if kind != "word":
                if kind == "num":
                    t = m.group(kind)
                    operands.append(float(t) if b"." in t else int(t))
                    pos = m.end()
                elif kind == "close":
                    pos = m.end()
                else:
                    try:
                        value, pos = sub.obj(pos)
                    except PdfError:
                        break
                    operands.append(value)
                if len(operands) > 10000:
                    operands = []
                continue
            op, pos = m.group(kind), m.end()
            if op == b"BI":                                   # an inline image: its data skipped
                at = re.compile(rb"[\x00\t\n\x0c\r ]ID[\x00\t\n\x0c\r ]").search(data, pos)
                end_image = re.compile(rb"[\x00\t\n\x0c\r ]EI(?=[\x00\t\n\x0c\r ]|$)")
                stop = end_image.search(data, at.end()) if at else None
                pos = stop.end() if stop else end
            try:
                PDF_OPERATORS.get(op, pdf_other_operator)(st, op, operands)
            except (IndexError, TypeError, ValueError, ZeroDivisionError, OverflowError):
                # an operator with operands it cannot take
                pass
            operands = []

    def show(self, op, operands, st):
        """A text-showing operator (Tj, TJ, ' and "): its strings as runs in page space (and
        TJ's numbers, which move the pen)."""
        if op in (b"'", b'"'):
            if op == b'"' and len(operands) >= 3:
                st.tw, st.tc = operands[-3], operands[-2]
            st.move(0, -st.tl)
        if st.font is None:
            return
        items = operands[-1] if op == b"TJ" else [operands[-1]]     # (none: IndexError, skipped)
        font, size, th = st.font, st.size, st.th
        for item in items if isinstance(items, list) else [items]:
            tm = st.tm
            if isinstance(item, bytes):
                self.draw(st, item)
            elif isinstance(item, (int, float)):
                shift = -item / 1000.0 * size * th
                if font.vertical:                           # a positive number moves down
                    st.tm = tm[:4] + [tm[4] + shift * tm[2] / th, tm[5] + shift * tm[3] / th]
                else:
                    st.tm = tm[:4] + [tm[4] + shift * tm[0], tm[5] + shift * tm[1]]

    def draw(self, st, string):
        """One string of a text-showing operator: its text as a PdfRun in page space, the
        pen moved past it."""
        font, size, tc, tw, th, tm = st.font, st.size, st.tc, st.tw, st.th, st.tm
        rise = 0 if font.vertical else st.rise              # (down a column: none)
        text, width, codes, spaces, missing = font.decode(string)
        self.unmapped += missing
        spacing = -tc if font.vertical else tc * th
        if spacing > 0.15 * abs(size * font.em):
            text = " ".join(text)                   # letter-spaced: each one a word apart
        m0 = pdf_mul(tm, st.ctm)
        if font.vertical:                           # down a column: w1 x size + Tc + Tw
            advance = font.down * codes * size - tc * codes - tw * spaces
            st.tm = tm[:4] + [tm[4] - advance * tm[2], tm[5] - advance * tm[3]]
        else:
            advance = (width * size + tc * codes + tw * spaces) * th
            st.tm = tm[:4] + [tm[4] + advance * tm[0], tm[5] + advance * tm[1]]
        m1 = pdf_mul(st.tm, st.ctm)
        scale = size * font.em * (abs(m0[2] * m0[2] + m0[3] * m0[3]) ** 0.5 or 1)
        if text:
            st.runs.append(PdfRun(m0[4] + rise * m0[2], m0[5] + rise * m0[3], m1[4] + rise * m1[2],
                                  m1[5] + rise * m1[3], abs(scale) or 1.0, text, font.vertical))

    def form(self, st, name):
        """Do: a form XObject's content run inside the page (12 deep at most,
        none inside itself)."""
        ref = st.xobjects.get(name) if isinstance(name, str) else None
        form = self.get(ref)
        if isinstance(form, PdfStream) and form.dict.get("Subtype") == "Form" and st.depth < 12 \
                and ref not in st.forms:
            matrix = form.dict.get("Matrix")
            matrix = [float(x) for x in matrix] if isinstance(matrix, list) and len(matrix) == 6 \
                else [1, 0, 0, 1, 0, 0]
            inner = self.entry(form.dict, "Resources", dict, st.resources)
            self.run(self.body(form) or b"", inner,
                     pdf_mul(matrix, st.ctm), st.runs, st.depth + 1, st.forms | {ref})

def pdf_job(job, emit):
    """A helper's side of view: [{count, title, texts of pages first..last}] of the file
    job['path'] names (the one the server checked: open_checked), or a ToolError saying
    what is wrong."""
    try:
        with open_checked(job) as f:
            data = f.read(job["limit"] + 1)
        pdf = Pdf(data)
        pages = pdf.pages()
        first, last = job["first"], job["last"] or len(pages)
        if not pages:
            raise PdfError("no pages found (a damaged file?)")
        if max(first, last) > len(pages):
            raise ToolError(INVALID_INPUT, "pages %s: the PDF has %s"
                            % (job["asked"], plural(len(pages), "page")))
        texts = []
        for page, resources in pages[first - 1:last]:
            try:
                texts.append(pdf.page_text(page, resources))
            except PdfBomb:
                raise
            except PDF_DAMAGE + PDF_BUGS + (PdfError,) as e:
                # one damaged page: said on it, the rest read
                texts.append("[this page could not be read: %s]" % pdf_failure(e))
        emit([{"count": len(pages), "title": pdf.info(), "texts": texts}])
    except PDF_DAMAGE + PDF_BUGS + (PdfError,) as e:
        bug = isinstance(e, PDF_BUGS)
        raise ToolError(IO_ERROR if bug else INVALID_INPUT, "not a readable PDF: %s%s" % (
            pdf_failure(e), "; pdftotext reads it if installed" if bug else ""))


# What a damaged file can raise inside the parser (that checks what it reads), and what only
# a bug of the parser's can: the first is the file's fault, the second is logged as boris's.
PDF_DAMAGE = (ValueError, IndexError, OverflowError, MemoryError, LookupError, ZeroDivisionError,
              RecursionError)
PDF_BUGS = (TypeError, AttributeError, KeyError, NameError)


def pdf_failure(e):
    """What an exception out of the PDF reader says of the file
    (a bug of the reader's is logged)."""
    if isinstance(e, PDF_BUGS):
        log("error", "the PDF reader failed: a bug", error=_traceback())
        return "the PDF reader failed (%s: %s), a bug in boris, logged with its traceback" % (
            type(e).__name__, shorten(str(e), 120))
    if isinstance(e, RecursionError):
        return "its objects are nested too deeply"
    if isinstance(e, PdfError):
        return str(e)
    return "%s: %s" % (type(e).__name__, shorten(str(e), 120))


###############################################################################
# Helpers #####################################################################
###############################################################################
# -- searches run where they can be killed ----------------------------------------
# Python's re holds the interpreter while it matches, so a catastrophic pattern (or a
# glob such as *a*a*a*a*b) run in this process would freeze ping, cancel and every
# other session. Every search therefore runs as a job in a search helper process
# (its own process group): this process only waits on a pipe, reads result batches as
# they come, and kills the group on cancel or at SEARCH_TIMEOUT_S, keeping what had arrived.
# Idle helpers are kept for the next search (SEARCH_IDLE_HELPERS) and exit when this process's
# end of the pipe closes.
#
# The search wire protocol: every message is one JSON object on one line.
#
#   from -> to                 message                              when
#   server -> search helper    a job: {"op": "grep"|"glob"|"match"|  one per search; grep_job_of,
#                              "outline"|"document"|"pdf", ...,      find_paths, output_test,
#                              "deadline_s"}                         outline and view
#   search helper -> server    {"items": [...]}                     as results come (Batches:
#                                                                   SEARCH_BATCH items or 0.2 s)
#   search helper -> server    {"end": "ok"} or {"end": "error",    the job's last line
#                              "code", "message"}
#
# Items: a grep job's are GrepHit records (JSON arrays); a glob job's are flat,
# [rel, mtime, rel, mtime, ...] (a list per path would double the JSON work), read
# back as (rel, mtime) pairs by glob_pairs() - plain tuples, not records: making 30,000
# namedtuples and sorting them by attribute costs a glob 15%. A match job's one item
# is true or false.

SearchRoot = namedtuple("SearchRoot", "real is_dir ino")
SearchRoot.__doc__ = """Where a search starts (search_root's): the real path, whether it is a
directory, and the inode a file root must still have (None for a directory). A job carries
its roots as JSON arrays; GrepWork reads them back into SearchRoots."""

GrepSpec = namedtuple("GrepSpec", "pattern regex ignore_case multiline mode before after"
                      " max_records stop_after", defaults=(None, None))
GrepSpec.__doc__ = """A grep job's settings (grep_spec's dict, sent as JSON), read back by
GrepWork: the pattern and how it matches, the output mode, context lines, how many records
a file may give (None: OUTPUT_MAX_CHARS // 2) and, for a head_limit search, after how many
records the search ends (None: it runs to the end)."""

GrepHit = namedtuple("GrepHit", "real rel mtime result root")
GrepHit.__doc__ = """One file's grep result: its real path, its path relative to the
root (None for a file root), mtime in ns (files_with_matches mode only, else 0),
result (GrepWork.file_result's: True, a count, records, or why the file could not be
read) and the index of its root."""


def glob_pairs(flat):
    """(rel, mtime) pairs of a glob job's flat items."""
    return zip(flat[0::2], flat[1::2])


def mtime(path):
    """Modification time in ns (an int: a fifth of the JSON cost of a float), 0 if gone."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0  # gone since it was listed: sorts as oldest


def policy_spec(policy):
    """What a helper needs to rebuild `policy`."""
    return {"allow": policy.allow, "deny": policy.deny_raw, "workdir": policy.workdir,
            "folds": policy.folds}


def name_filter(include, type_name):
    """(rel, name) -> bool from an include glob and a language type; None without either."""
    tests = []
    if include:
        try:
            rx = compile_glob(include)
        except ValueError as e:
            raise ToolError(INVALID_INPUT, "include glob %r is malformed: %s" % (include, e))
        on_path = "/" in include
        tests.append(lambda rel, name: rx.match(rel if on_path else name) is not None)
    if type_name:
        by_type = type_matcher(type_name)
        tests.append(lambda rel, name: by_type(name))
    if not tests:
        return None
    return tests[0] if len(tests) == 1 else lambda rel, name: all(t(rel, name) for t in tests)


# -- the grep and glob jobs -------------------------------------------------------
class GrepWork:
    """A grep or search_text job as each of its workers runs it: roots are SearchRoots;
    file_hits() turns what a walk found into the items to send, [GrepHit], or None."""

    def __init__(self, job, cache=None):
        self.job, self.cache = job, cache
        self.roots = [SearchRoot(*r) for r in job["roots"]]
        # a root's path/ prefix, cut off a path
        self.cuts = [len(child_prefix(r.real)) for r in self.roots]
        self.policy = PathPolicy(**job["policy"])
        self.keep = name_filter(job.get("include"), job.get("type"))
        self.spec = spec = GrepSpec(**job["spec"])
        self.matcher = Matcher(spec.pattern, spec.regex, spec.ignore_case, spec.multiline)
        self.mode, self.before, self.after = spec.mode, spec.before, spec.after
        self.max_records = spec.max_records or OUTPUT_MAX_CHARS // 2
        self.buf = bytearray(GREP_BUFFER)               # (grown for a long line: reads on more)
        # gather()'s own buffer, pinned for its finder (file_hits() may grow self.buf)
        self.fast = bytearray(GREP_BUFFER)
        self.contains = finder(self.fast)

    def walker(self, k):
        """A Walker of root k that follows directory links (as grep -R does)."""
        walker = Walker(self.roots[k].real, self.policy, True, self.cache)
        walker.ignores = not self.job.get("no_ignore")
        return walker

    def file_hits(self, k, path, real, is_dir, ino):
        """[GrepHit] for one walked file that passes include/type and matches, else None."""
        rel = path[self.cuts[k]:] if self.roots[k].is_dir else None
        if rel is not None and self.keep and not self.keep(rel, path[path.rfind("/") + 1:]):
            return None
        r = self.file_result(real, ino)
        if r is None:
            return None
        return [GrepHit(real, rel, mtime(real) if self.mode == "files_with_matches" else 0, r, k)]

    def gather(self, k, walked, items):
        """Append to `items` what file_hits() makes of each (path, real, is_dir, inode) walked
        (`-l` of a literal, the search agents make most, through listed())."""
        if self.mode == "files_with_matches" and self.matcher.literal is not None:
            return self.listed(k, walked, items)
        for found in walked:
            items += self.file_hits(k, *found) or ()

    def listed(self, k, walked, items):
        """gather() of `-l` for a literal: one loop with file_hits()'s steps inline. A file
        its first read does not settle (bigger than the buffer, with a byte-order mark, or
        a read that failed: file_hits() says why) goes through file_hits()."""
        matcher, file_hits = self.matcher, self.file_hits
        buf, contains, needle = self.fast, self.contains, matcher.literal
        cut = self.cuts[k] if self.roots[k].is_dir else None
        size, sniff, folded, keep = len(buf), GREP_BINARY_SNIFF, matcher.folded, cut and self.keep
        open_, fstat, readv, close = os.open, os.fstat, os.readv, os.close
        flags, regular = os.O_RDONLY | O_FILE, stat.S_ISREG
        for path, real, is_dir, ino in walked:
            if keep and not keep(path[cut:], path[path.rfind("/") + 1:]):
                continue                            # (a file root is searched whatever its name)
            try:
                fd = open_(real, flags)
                try:
                    st = fstat(fd)
                    if not regular(st.st_mode) or ino is not None and st.st_ino != ino:
                        continue
                    n = readv(fd, [buf])
                finally:
                    close(fd)
            except OSError:
                n = size
            if n >= size or n and buf[0] >= 0xef:
                items += file_hits(k, path, real, is_dir, ino) or ()
            elif (buf[:n].lower().find(needle) >= 0 if folded else contains(n, needle)) \
                    and buf.find(b"\x00", 0, min(n, sniff)) < 0:
                items.append(GrepHit(real, None if cut is None else path[cut:], st.st_mtime_ns,
                                     True, k))

    def file_result(self, path, ino):
        """One file's result: None (binary, gone, not a regular file, no longer the inode
        `ino` the walk listed, or no match), True (files mode), a count (count mode), a list
        of records (content mode), or why it could not be read (a str: the answer counts
        those). Steps: open it if it is still the file the walk listed, read the first piece
        (binary: None at once; most files are this one piece, else read_chunks' pieces), run
        the matcher over the pieces (count or records)."""
        try:
            fd = os.open(path, os.O_RDONLY | O_FILE)
        except FileNotFoundError:
            return None                                     # gone since the walk listed it
        except OSError as e:
            return e.strerror
        try:
            st, buf, content = os.fstat(fd), self.buf, self.mode == "content"
            if not stat.S_ISREG(st.st_mode) or ino not in (None, st.st_ino):
                return None                                 # another file now
            n = os.readv(fd, [buf])
            if n >= len(buf) or n and buf[0] >= 0xfe:                  # (0xff, 0xfe: a UTF-16 BOM?)
                whole = content and bool(self.before or self.after or self.matcher.multiline)
                pieces = self.read_chunks(fd, buf, n, whole, numbered=content)
            elif buf.find(b"\x00", 0, min(n, GREP_BINARY_SNIFF)) >= 0:
                return None
            else:
                pieces = ((buf, n, 1),)
            return self.records(pieces) if content else self.count(pieces)
        except OSError as e:
            return e.strerror
        finally:
            os.close(fd)

    def text_piece(self, piece):
        """A piece (haystack, end, first line) as the matcher reads it: decoded when the
        pattern needs text, without the UTF-8 BOM that is not part of line 1."""
        hay, end, first = piece
        if self.matcher.needs_text(hay, end):
            hay = hay[:end].decode("utf-8", "surrogateescape")
            end = len(hay)
        if first == 1 and hay[:1] in ("\ufeff", b"\xef"):
            bom = 1 if isinstance(hay, str) else 3 if hay[:3] == b"\xef\xbb\xbf" else 0
            hay, end = hay[bom:end], end - bom
        return hay, end, first

    def count(self, pieces):
        """Files and count modes over a file's pieces: True on the first match (files
        mode), the number of matches (count mode; a multiline match counts its lines), or
        None for no match and for a binary file."""
        matcher, files_only, count = self.matcher, self.mode == "files_with_matches", 0
        for piece in pieces:
            if piece is None:
                return None                             # binary, found past the first piece
            hay, end, first = self.text_piece(piece)
            spans = matcher.spans(hay, end, files_only)
            if spans and files_only:
                return True
            if spans and matcher.multiline:
                spans = [r for r in LineRecords().add(hay, end, first, spans) if r]
            count += len(spans)
        return count or None

    def records(self, pieces):
        """Content mode over a file's pieces: the records LineRecords makes, at most
        `max_records` (more could never be shown), or None for no match and binary files."""
        records, made, max_records = [], LineRecords(self.before, self.after), self.max_records
        for piece in pieces:
            if piece is None:
                return None
            hay, end, first = self.text_piece(piece)
            spans = self.matcher.spans(hay, end, False)
            if spans:
                records += made.add(hay, end, first, spans)
            if len(records) >= max_records:
                del records[max_records:]
                break
        return records or None

    @staticmethod
    def read_chunks(fd, buf, n, whole=False, numbered=True):
        """Yield (hay, end, first_line) pieces of a file ending at line boundaries, `buf`
        holding its first n bytes already; one piece for any file that fits in `buf`, or
        (whole=True: context lines or multiline matches must not be cut at a seam) up to
        GREP_CHUNK_MAX. None first for a binary file. A UTF-16 file with a BOM comes as
        one piece transcoded to UTF-8. first_line is 1 for every piece unless numbered."""
        if buf[:2] in (b"\xff\xfe", b"\xfe\xff"):
            data = bytes(buf[:n]) + read_fd(fd, GREP_CHUNK_MAX, "")
            text = data.decode("utf-16", "replace").encode("utf-8", "surrogateescape")
            yield text, len(text), 1
            return
        if buf.find(b"\x00", 0, min(n, GREP_BINARY_SNIFF)) >= 0:
            yield None
            return
        line, filled = 1, n
        while True:
            if filled < len(buf):
                yield buf, filled, line
                return
            end = buf.rfind(b"\n", 0, filled) + 1
            if end == 0 or whole:
                if len(buf) < GREP_CHUNK_MAX:
                    # a very long line, or a whole file: grow and read on
                    buf.extend(bytes(len(buf)))
                    filled += os.readv(fd, [memoryview(buf)[filled:]])
                    continue
                end = end or filled
            yield buf, end, line
            if numbered:
                line += buf.count(b"\n", 0, end)
            carry = filled - end
            buf[0:carry] = buf[end:filled]
            filled = carry + os.readv(fd, [memoryview(buf)[carry:]])


class GlobWork:
    """A glob or search_files job as each of its workers runs it: one root, the
    static directory `start`; gather() appends rel, mtime for each match, items sent
    flat (rel, mtime, rel, mtime, ...: a list per match would double the JSON work)."""

    def __init__(self, job, cache=None):
        self.job, self.cache = job, cache
        self.policy = PathPolicy(**job["policy"])
        start, rest, self.base_only = job["start"], job["rest"], job["base_only"]
        self.roots = [SearchRoot(start, True, None)]
        self.rx, self.lead = compile_glob(rest), job["lead"]
        self.cut = len(child_prefix(start))
        self.want_dir = job["kind"] == "directory"          # (else "file")
        self.name_ok = None
        if self.base_only and not self.want_dir:     # C-level tests: called once per file walked
            simple = re.match(r"^\*(\.[\w.+-]+)$", rest)      # '*.c': a suffix test, no regex
            self.name_ok = methodcaller("endswith", simple.group(1)) if simple else self.rx.match
        self.depth = None if self.base_only or "**" in rest else rest.count("/") + 1
        self.watches = cache.watches if cache is not None else None
        self.visited = [] if self.watches is not None else None
        self.links_seen = [] if self.watches is not None else None
        # (path, mtime) of matches found through a link
        self.linked = []
        # 1: a match no watch vouches for (one is enough)
        self.unkept = 0

    def walker(self, k):
        """A Walker of the static start directory that lists links and does not enter them,
        names filtered in the walk when it can be. Its visits are kept for the next glob only in
        a warm helper's cache (with watches)."""
        walker = Walker(self.roots[0].real, self.policy, False, self.cache)
        # (name_key: what name_ok tests)
        walker.only(self.name_ok, self.job["rest"]).remember = self.watches is not None
        walker.want_dirs, walker.max_depth = self.want_dir, self.depth
        walker.visited, walker.links_seen = self.visited, self.links_seen
        return walker

    def recall(self):
        """The batches this very job gave last time, if nothing they came from changed since
        (the watches saw no event, the ignore files above the start are the same, each
        symlink met names what it named, with the same mtime); else None."""
        if self.watches is None:
            return None
        self.key = json.dumps(dict(self.job, deadline_s=None), sort_keys=True)
        self.since, self.outer = self.watches.generation, self.cache.outer(self.roots[0].real)
        known = self.cache.results.get(self.key)
        if known is None or known[0] != self.since or not same_objects(known[1], self.outer):
            return None
        _, _, batches, links, linked = known
        walker = self.walker(0)
        if any(walker.resolve_link(*args) != found for args, found in links) \
                or any(mtime(path) != when for path, when in linked):
            return None
        self.cache.results.move_to_end(self.key)
        flat = [[0] * (2 * len(whens)) for _, whens in batches]
        for one, (rels, whens) in zip(flat, batches):
            one[0::2], one[1::2] = rels.split("\0"), whens
        return flat

    def keep(self, batches):
        """Keep what this job gave for recall() when all of it is watched: every directory it
        visited was walked here and is clean, every match vouched for (GLOB_RESULTS_KEPT jobs)."""
        if self.watches is None:
            return
        if self.unkept or not all(map(self.watches.clean.__contains__, self.visited)):
            self.cache.results.pop(self.key, None)
            return
        self.cache.results[self.key] = (self.since, self.outer, batches, self.links_seen,
                                        self.linked)
        while len(self.cache.results) > GLOB_RESULTS_KEPT:
            self.cache.results.popitem(last=False)

    def gather(self, k, walked, items):
        """Append rel, mtime to `items` for each match walked (one loop, no call per
        path but the stat: a big glob is mostly this loop). Notes the first match no watch
        vouches for (keep(); the rest are not looked at): in a directory not watched, or
        with other hard links (a change through one elsewhere raises no event here)."""
        lead, cut, rx = self.lead, self.cut, self.rx
        base_only, want_dir, stat_of = self.base_only, self.want_dir, os.stat
        # the walker has matched the names already
        filtered = self.name_ok is not None
        watches = self.watches
        for path, real, is_dir, ino in walked:
            if not filtered and (is_dir != want_dir or not rx.match(
                    path[path.rfind("/") + 1:] if base_only else path[cut:])):
                continue
            try:
                st = stat_of(path)
                when = st.st_mtime_ns
            except OSError:
                when = 0
            else:
                if watches is not None and path != real:
                    self.linked.append((path, when))        # (recall() reads its mtime again)
                elif watches is not None and not self.unkept and (
                        is_dir or st.st_nlink != 1 or not watches.file_watched(path)):
                    # (a change through another hard link: no event here)
                    self.unkept = 1
            # the full path would double what the pipe carries
            items += (path[lead:], when)


SEARCH_WORK = {"grep": GrepWork, "glob": GlobWork}


# -- a job's batches ---------------------------------------------------------------
class Batches:
    """Items handed to emit() in batches: at SEARCH_BATCH, after 0.2 s, and at the end."""

    def __init__(self, emit, keep=False):
        self.emit, self.items, self.sent = emit, [], time.monotonic()
        # with keep: every glob batch emitted, as its paths joined by NULs and their mtimes (a
        # third of the memory of the list)
        self.kept = [] if keep else None

    def flush_due(self):
        """Flush at SEARCH_BATCH items, or when 0.2 s passed since the last flush."""
        if len(self.items) >= SEARCH_BATCH or time.monotonic() - self.sent > 0.2:
            self.flush()

    def flush(self):
        """Emit what is in; the list stays the same object (a gather() may be adding to it)."""
        if self.items:
            batch = self.items[:]
            del self.items[:]
            if self.kept is not None:
                self.kept.append(("\0".join(batch[0::2]), array("q", batch[1::2])))
            self.emit(batch)
        self.sent = time.monotonic()


def search_job(job, emit, cache=None):
    """Run a search job, handing results to emit() as they come: a grep or glob walks
    its roots (flushing its batches after each directory), an outline, document or pdf
    job reads its files, and a 'match' job tests a wait_for pattern."""
    op = job["op"]
    if op == "outline":
        return Outline.job(job, emit, cache)
    reader = {"match": match_job, "document": Document.job, "pdf": pdf_job}.get(op)
    if reader is not None:
        return reader(job, emit)
    work = SEARCH_WORK[op](job, cache)
    if op == "grep" and work.spec.stop_after:
        return grep_until(work, emit)
    globbing = op == "glob"
    recalled = work.recall() if globbing else None
    if recalled is not None:
        for batch in recalled:
            emit(batch)
        return
    out = Batches(emit, keep=globbing)
    dealt = job.get("slice")                    # [i, n]: slice i of n (HelperPool.run)
    for k, (real, is_dir, ino) in enumerate(work.roots):
        # (a file: slice 0's)
        walked = [(real, real, False, ino)] if not (dealt and dealt[0]) else []
        if is_dir:
            walked = work.walker(k)
            walked.tick, walked.slice = out.flush_due, dealt
        work.gather(k, walked, out.items)
        out.flush_due()
    out.flush()
    if globbing:
        work.keep(out.kept)


def grep_until(work, emit):
    """A grep that stops at spec.stop_after records: each file is searched as the
    walk finds it, in walk order, and the walk ends with the search."""
    left = work.spec.stop_after
    for k, (real, is_dir, ino) in enumerate(work.roots):
        for found in work.walker(k) if is_dir else [(real, real, False, ino)]:
            work.max_records = left
            items = work.file_hits(k, *found)
            if items:
                emit(items)
                left -= len(items[0].result) if isinstance(items[0].result, list) else 0
                if left <= 0:
                    return


def helper_search():
    """A search helper: one JSON job a line on stdin, until it closes; for each, lines
    {"items": [...]} as results come, then {"end": "ok"} or {"end": "error", code,
    message} (a traceback on stderr). Each job carries its deadline here too: SIGALRM,
    whose default action the kernel carries out even while a regex holds the
    interpreter, ends the helper DEADLINE_GRACE_S after it."""
    alarms = hasattr(signal, "setitimer")
    out = sys.stdout.buffer
    cache = WalkCache(watch=True)       # this helper's, for all its jobs

    def emit(items):
        if items:
            out.write(json.dumps({"items": items}).encode("ascii") + b"\n")
            out.flush()
    for line in iter(sys.stdin.buffer.readline, b""):
        job = json.loads(line.decode("utf-8", "surrogateescape"))
        if alarms and job.get("deadline_s"):
            signal.setitimer(signal.ITIMER_REAL, job["deadline_s"] + DEADLINE_GRACE_S)
        try:
            cache.refresh()
            search_job(job, emit, cache)
            end = {"end": "ok"}
        except (ToolError, ImportError, OSError) as e:
            e = e if isinstance(e, ToolError) else lacking(e)
            end = {"end": "error", "code": e.code, "message": e.message}
        except Exception as e:
            sys.stderr.write("boris: search helper %d: the job failed:\n%s"
                             % (os.getpid(), _traceback()))
            sys.stderr.flush()
            end = {"end": "error", "code": IO_ERROR,
                   "message": "the helper's job failed (%r), a bug in boris, logged with its "
                              "traceback" % e}
        finally:
            if alarms:
                signal.setitimer(signal.ITIMER_REAL, 0)
        out.write(json.dumps(end).encode("ascii") + b"\n")
        out.flush()


def match_job(job, emit):
    """Emit [True] when a line (its first WAIT_FOR_LINE_CHARS) of job['text'] matches the
    regex job['pattern'], else [False]: a wait_for test, run where it can be killed."""
    try:
        rx = re.compile(job["pattern"], re.MULTILINE)
    except (re.error, RecursionError, OverflowError, ValueError) as e:
        raise ToolError(INVALID_INPUT, "wait_for %r is not a valid regular expression: %s"
                        % (shorten(job["pattern"]), e))
    emit([any(rx.search(line[:WAIT_FOR_LINE_CHARS]) for line in job["text"].splitlines())])


# -- the helper pool ---------------------------------------------------------------

class HelperPool:
    """The one owner of a server's search helpers, busy or idle: it starts them (from
    a thread of its own, since PR_SET_PDEATHSIG fires when the thread that forked a
    child ends, and worker threads retire), hands each job to one, keeps up to
    SEARCH_IDLE_HELPERS (or one a slice) warm for the next job, kills a busy one's whole
    process group on cancel or at the deadline, and kills them all on close(). A helper
    that cannot be started is an IO_ERROR: a search never falls back to this process,
    where neither cancel nor the deadline could stop it."""

    def __init__(self, avoid=()):
        # roots sandboxed commands may write: no helper code there
        self.avoid = list(avoid)
        self.lock = threading.Lock()
        self.idle, self.busy = [], set()
        self.closed = False
        # spawn requests to the pool's own thread
        self.requests = None
        # the boxes of helpers started ahead (prime()), not taken yet
        self.primed = []

    def run(self, job, cancelled, deadline_s=None):
        """(items, None) of a job run in a helper, or in SEARCH_SLICES of them, each with a
        slice of the tree, for a grep or glob that need not stop early; (items so far,
        'deadline' or 'cancelled') when they had to be killed."""
        deadline_s = SEARCH_TIMEOUT_S if deadline_s is None else deadline_s
        dealt = job["op"] in ("grep", "glob") and not job.get("spec", {}).get("stop_after")
        n = SEARCH_SLICES if dealt else 1
        deadline = time.monotonic() + deadline_s
        items, procs = [], {}                  # stdout -> (helper, LineBuffer) of those not done
        try:
            for i in range(n):
                proc = self.start(dict(job, deadline_s=deadline_s,
                                       slice=[i, n] if n > 1 else None), i)
                procs[proc.stdout.fileno()] = proc, LineBuffer()
            while procs:
                if cancelled.is_set():
                    return items, "cancelled"
                left = deadline - time.monotonic()
                if left <= 0:
                    return items, "deadline"
                for fd in ready(list(procs), min(0.05, left)):
                    proc, reader = procs[fd]
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        raise ToolError(IO_ERROR,
                                        "the search helper process ended unexpectedly (its error,"
                                        " if any, is in the server's log); try again")
                    for line in reader.feed(chunk):
                        msg = json.loads(line.decode("utf-8"))
                        if "items" in msg:
                            items += msg["items"]
                            continue
                        del procs[fd]
                        self.release(proc)
                        if msg["end"] != "ok":
                            raise ToolError(msg["code"], msg["message"])
            return items, None
        except (OSError, ValueError) as e:
            raise ToolError(IO_ERROR, "the search helper failed: %s" % e)
        finally:
            for proc, _ in procs.values():     # (cut short: the others are killed too)
                self.discard(proc)

    def start(self, job, slot=0):
        """A helper that has taken `job` (a warm one that died is replaced once); the one
        that ran this slot last, if idle."""
        data = json.dumps(job).encode("utf-8", "surrogateescape") + b"\n"
        error = None
        for _ in range(2):
            try:
                proc = self.checkout(slot)
            except OSError as e:
                error = e
                continue
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
                return proc
            except OSError as e:
                error = e
                self.discard(proc)
        raise ToolError(IO_ERROR,
                        "no search helper process could be started (%s), so the search was not run;"
                        " check that %s can start and that the temp directory is writable"
                        % (getattr(error, "strerror", None) or error, sys.executable))

    def checkout(self, slot=0):
        """An idle helper (the one that ran `slot` last, if there), or a new one (its own
        process group); marked busy."""
        with self.lock:
            if self.closed:
                raise OSError(errno.ESHUTDOWN, "the server is shutting down")
            idle = next((p for p in self.idle if p.slot == slot),
                        self.idle[-1] if self.idle else None)
            if idle is not None and idle.poll() is None:
                self.idle.remove(idle)
                self.busy.add(idle)
                idle.slot = slot
                return idle
            if idle is None:                      # prime()'s, perhaps still booting, or a new one
                primed = bool(self.primed)
                box = self.primed.pop() if primed else self.request_locked()
            else:
                self.idle.remove(idle)
        if idle is not None:
            kill_group(idle)  # it died while idle: reaped, pipes closed; try again
            return self.checkout(slot)
        try:
            proc = self.collect(box)
        except OSError:
            if not primed:
                raise
            return self.checkout(slot)                # (prime()'s failed: this one starts its own)
        proc.slot = slot
        with self.lock:
            self.busy.add(proc)
            closed = self.closed
        if closed:
            self.discard(proc)
            raise OSError(errno.ESHUTDOWN, "the server is shutting down")
        return proc

    def prime(self):
        """Start a helper for each slice now, in the background, for the first search to take:
        a helper takes ~25 ms to boot (the whole file to compile when its bytecode is not cached
        yet), which the server's start and the client's handshake then hide. Nothing
        when a helper is there already or the pool is closed."""
        with self.lock:
            if not self.closed and not self.idle and not self.busy and not self.primed:
                self.primed = [self.request_locked() for _ in range(SEARCH_SLICES)]

    def request_locked(self):
        """Ask the pool's thread (started on first use) for a new helper: the box it will be
        put in (an OSError in it once the pool is closed). The caller holds the lock (the name
        says so, as the standard library's _locked methods do)."""
        if self.closed:
            box = queue.SimpleQueue()
            box.put(OSError(errno.ESHUTDOWN, "the search helpers were stopped with their server"))
            return box
        if self.requests is None:
            self.requests = queue.SimpleQueue()
            threading.Thread(target=self._spawner, args=(self.requests, self.avoid), daemon=True,
                             name="boris-helper-spawner").start()
            atexit.register(self.close)  # idle helpers go with the process, whoever runs it
        box = queue.SimpleQueue()
        self.requests.put(box)
        return box

    @staticmethod
    def collect(box, timeout=None):
        """The helper put in `box` (request_locked()), or its OSError raised."""
        proc = box.get(timeout=timeout)
        if isinstance(proc, Exception):
            raise proc
        return proc

    @staticmethod
    def _spawner(requests, avoid):
        import subprocess
        for box in iter(requests.get, None):
            try:
                argv, cwd = helper_command("search", avoid)
                box.put(spawn(argv, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              start_new_session=True))
            except Exception as e:  # any failure is an answer: no caller waits for ever
                box.put(e if isinstance(e, OSError) else OSError(repr(e)))

    def release(self, proc):
        """A helper that finished its job: kept warm, or closed."""
        with self.lock:
            self.busy.discard(proc)
            keep = (not self.closed and len(self.idle) < max(SEARCH_IDLE_HELPERS, SEARCH_SLICES)
                    and proc.poll() is None)
            if keep:
                self.idle.append(proc)
        if not keep:
            kill_group(proc)

    def discard(self, proc):
        """Kill a helper and forget it."""
        with self.lock:
            self.busy.discard(proc)
            if proc in self.idle:
                self.idle.remove(proc)
        kill_group(proc)

    def close(self):
        """Kill every helper, busy or idle; no new one starts."""
        with self.lock:
            self.closed = True
            procs = self.idle + list(self.busy)
            self.idle, self.busy = [], set()
            requests, self.requests = self.requests, None
            primed, self.primed = self.primed, []
        if requests is not None:
            requests.put(None)
        for box in primed:
            try:
                procs.append(self.collect(box, timeout=5))
            except (OSError, queue.Empty):
                pass  # it did not start (or the spawning thread is gone at exit): nothing to kill
        for proc in procs:
            kill_group(proc)


###############################################################################
# Shell #######################################################################
###############################################################################
# What a command prints, kept bounded (Capture), and the command runner: a command
# started in its own process group (through the sandbox's launcher when it is on),
# its pipes pumped, its deadline and cancel kept, its ending described.

LEFTOVER_DRAIN_S = 0.2                     # after a command exits, wait this long for its pipes
SHELL = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
# a long output shows its first 20,000 characters and its last 10,000 (where summaries and
# the sentinel are)
CAPTURE_HEAD_CHARS = OUTPUT_MAX_CHARS * 2 // 3
CAPTURE_TAIL_CHARS = OUTPUT_MAX_CHARS // 3
CAPTURE_HEAD_BYTES = CAPTURE_HEAD_CHARS * 4
CAPTURE_TAIL_BYTES = CAPTURE_TAIL_CHARS * 4


class Capture:
    """A stream's output in bounded memory, in time linear in its size: the head and
    the tail kept as bytes, the full length counted in characters."""

    def __init__(self):
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, data):
        """Take in a chunk of output: counted whole, its head and tail kept."""
        self.total += len(data)
        self.chars += len(self._decoder.decode(data))
        room = CAPTURE_HEAD_BYTES - len(self.head)
        if room > 0:
            self.head += data[:room]
        self.tail += data
        if len(self.tail) > 2 * CAPTURE_TAIL_BYTES:
            del self.tail[:-CAPTURE_TAIL_BYTES]

    def complete(self):
        """Whether everything captured is in the head (nothing was cut)."""
        return self.total == len(self.head)

    def strip_sentinel(self, marker):
        """Remove the sentinel line from the end; return the cwd it named, or None."""
        m = re.search(re.escape(b"\n" + marker) + rb"([^\n]*)\n\Z", self.tail)
        if not m:
            return None
        cwd = bytes(m.group(1)).decode("utf-8", "surrogateescape")
        cut = len(self.tail) - m.start()
        self.chars -= len(bytes(self.tail[m.start():]).decode("utf-8", "replace"))
        self.total -= cut
        del self.tail[m.start():]
        del self.head[self.total:]
        return cwd

    def render(self, label, limit):
        """(text, notice): all of it and None, or its first two thirds and its last
        third of `limit` characters with the length left out between, and the notice
        that says so."""
        head_n = limit * 2 // 3
        tail_n = limit - head_n
        if self.complete():
            text = bytes(self.head).decode("utf-8", "replace")
            if len(text) <= limit:
                return text, None
            head, tail = text[:head_n], text[-tail_n:]
        else:
            head = bytes(self.head).decode("utf-8", "replace")[:head_n]
            tail = bytes(self.tail).lstrip(bytes(range(0x80, 0xC0))).decode("utf-8", "replace")
            tail = tail[-tail_n:]
        omitted = max(0, self.chars - len(head) - len(tail))
        tail = tail.rstrip("\n")
        notice = ("[%s: %d characters in all; the first %d and the last %d are shown. Pipe long"
                  " output through tail, head or grep.]"
                  % (label, self.chars, len(head), len(tail)))
        return "%s\n\n... %d characters omitted ...\n\n%s" % (head, omitted, tail), notice


# -- the command runner ------------------------------------------------------------
# start_process, pump (a foreground call's read loop, PumpClock its deadlines) and Task
# (a command read by a thread of its own: a background task, or a foreground command
# that may be handed off). Output reaches a result through render_output.

def command_environ(config):
    """The environment bash commands get: the server's, less its own variables and those
    named like a secret unless --shell-env-keep names them, less what --shell-env-drop
    names (child_environ)."""
    return child_environ(None, config.shell_env_keep, config.shell_env_drop)


TTY_COLUMNS, TTY_ROWS = 80, 24             # the terminal of a tty task


def start_process(script, cwd, sandbox=None, stdin="null", environ=None, tied=False):
    """Popen of `script` under the shell (or of an argv list as it is: a program), in
    its own process group; through the launcher when `sandbox` is on or the command
    gets a terminal. stdin: 'null'
    (/dev/null: a prompt fails fast), 'pipe' (kept open for task_input) or 'tty' (a
    pseudo-terminal of TTY_COLUMNS x TTY_ROWS, TERM=dumb, stdout and stderr merged on
    it; proc.stdout reads its master, proc.stderr is None). `tied`: through the launcher,
    which has the kernel kill it when this thread ends (a language server)."""
    import subprocess
    sandbox = sandbox or Sandbox.off()
    env = dict(os.environ if environ is None else environ)
    env.setdefault("PAGER", "cat")
    env.setdefault("GIT_PAGER", "cat")
    env.setdefault("GIT_TERMINAL_PROMPT", "0")
    # this command's alone
    env["BORIS_CALL"] = marker = "%d-%s" % (os.getpid(), os.urandom(6).hex())
    env.update(sandbox.proxy_environ())
    argv = script if isinstance(script, list) else [SHELL, "-c", script]
    if sandbox.on and stdin == "null":
        return sandbox.launchers.start(argv, cwd, env, marker)
    if sandbox.on or stdin == "tty" or tied:
        argv, cwd = sandbox.launched(argv, cwd, stdin == "tty", tied)
    if stdin != "tty":
        proc = spawn(argv, cwd=cwd, env=env,
                     stdin=subprocess.PIPE if stdin == "pipe" else subprocess.DEVNULL,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                     close_fds=True)
        proc.boris_call = marker
        return proc
    import fcntl
    import termios
    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", TTY_ROWS, TTY_COLUMNS, 0, 0))
        env["TERM"] = "dumb"
        proc = spawn(argv, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave,
                     start_new_session=True, close_fds=True)
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    proc.stdout = os.fdopen(master, "rb", buffering=0)
    proc.boris_call = marker
    return proc


def pump(task, deadline, on_output):
    """Read both pipes of a Task's process into its Captures until it is done.

    Ends the group on `deadline` (monotonic) or when the task's `stop` is set: SIGTERM,
    then SIGKILL after the grace period. When the leader exits, leftover members holding
    the pipes get LEFTOVER_DRAIN_S before they are killed, so nothing outlives the
    call. Returns 'exited', 'timeout' or 'stopped'."""
    import subprocess
    proc, out, err, stop = task.proc, task.out, task.err, task.stop
    sel = pipe_selector(proc, out, err)
    clock = PumpClock(proc, deadline, stop)
    try:
        while sel.get_map() or proc.poll() is None:
            if clock.tick(time.monotonic()):
                break
            if not sel.get_map():
                # pipes closed, leader exiting: wait briefly, not a full tick
                try:
                    proc.wait(0.05)
                except subprocess.TimeoutExpired:
                    pass                # still exiting: the next tick decides
                continue
            for key, _ in sel.select(0.05):
                data = read_ready(key.fd)
                if data:
                    key.data.add(data)
                    if on_output is not None:
                        on_output(key.data is err, data)
                elif data is not None:
                    sel.unregister(key.fileobj)
    finally:
        sel.close()
        close_pipes(proc)
        signal_group(proc, signal.SIGKILL)
        proc.wait()
        kill_leftovers(proc)
    return clock.why


def pipe_selector(proc, out, err):
    """A selector over the command's stdout and stderr (a terminal has one stream),
    non-blocking, each keyed to its Capture."""
    import selectors
    sel = selectors.DefaultSelector()
    for f, cap in ((proc.stdout, out), (proc.stderr, err)):
        if f is not None:
            os.set_blocking(f.fileno(), False)
            sel.register(f, selectors.EVENT_READ, cap)
    return sel


class PumpClock:
    """What time means to one pump(): why the command ends (`exited`, `timeout`,
    `stopped`), and which signal its group gets when."""

    def __init__(self, proc, deadline, stop):
        self.proc, self.deadline, self.stop = proc, deadline, stop
        self.why = "exited"
        self.kill_at = None                 # SIGKILL due (a grace after SIGTERM)
        self.leader_gone_at = None          # when the leader was first seen exited

    def tick(self, now):
        """Signal the group as `now` demands: SIGTERM at the deadline or on stop, SIGKILL
        a grace later, SIGKILL once leftovers held the pipes LEFTOVER_DRAIN_S after the
        leader exited (then True: stop reading)."""
        if self.why == "exited":
            self.why = self.end_reason(now)
            if self.why != "exited":
                signal_group(self.proc, signal.SIGTERM)
                self.kill_at = now + KILL_GRACE_S
        if self.kill_at is not None and now >= self.kill_at:
            signal_group(self.proc, signal.SIGKILL)
            self.kill_at = None
        if self.leader_gone_at is None and self.proc.poll() is not None:
            self.leader_gone_at = now
        if self.leader_gone_at is not None and now - self.leader_gone_at > LEFTOVER_DRAIN_S:
            signal_group(self.proc, signal.SIGKILL)
            return True
        return False

    def end_reason(self, now):
        """`stopped` when asked to stop, `timeout` past the deadline, else `exited`."""
        if self.stop.is_set():
            return "stopped"
        if self.deadline is not None and now >= self.deadline:
            return "timeout"
        return "exited"


def read_ready(fd):
    """What a readable pipe or terminal holds: bytes, b"" at its end, None if nothing
    was there after all."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None  # nothing to read after all (spurious wakeup)
    except OSError as e:
        if e.errno != errno.EIO:             # EIO: a terminal whose every writer is gone
            raise
        return b""


def close_pipes(proc):
    """Close our ends of a command's pipes."""
    for f in (proc.stdout, proc.stderr, proc.stdin):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass                         # a close error on a pipe loses nothing


def describe_exit(proc):
    """The line that says how a command ended: its exit code, or the signal that killed it."""
    code = proc.returncode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "signal %d" % -code
        return "killed by %s" % name
    return "exit code: %s" % code


def render_output(out, err, total):
    """(text, notice): both streams within `total` characters (each within
    OUTPUT_MAX_CHARS; a short one whole, the rest to the other), and None or the
    notice of what was cut."""
    parts, notices = [], []
    for cap, label, limit in zip((out, err), ("stdout", "stderr"),
                                 stream_limits(out.chars, err.chars, total)):
        if cap.total:
            text, notice = cap.render(label, max(limit, 1000))
            parts.append("--- %s ---\n%s" % (label, text.rstrip("\n")))
            if notice:
                notices.append(notice)
    return ("\n".join(parts) if parts else "(no output)"), (" ".join(notices) or None)


_TERMINAL_CODES = (r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"
                   r"|\x1b[@-Z\\-_]|\x1b[()][0-9A-Za-z]")


def terminal_text(text):
    """What a terminal shows, as text: escape sequences (colours, cursor moves,
    titles) dropped, CR LF line ends as LF, a lone CR (a redrawn line) as a line end."""
    text = re.sub(_TERMINAL_CODES, "", text)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def stream_limits(out_chars, err_chars, total):
    """How many characters of stdout and of stderr fit in `total`."""
    a, b = min(out_chars, OUTPUT_MAX_CHARS), min(err_chars, OUTPUT_MAX_CHARS)
    if a + b <= total:
        return a, b
    # half each, or a short one whole and the rest to the other
    a = min(a, max(total // 2, total - b))
    return a, total - a


class Unread:
    """A stream's output not yet returned by task_output: a Capture (bounded, head and
    tail) swapped for a fresh one at each read."""

    def __init__(self):
        self.lock = threading.Lock()
        self.cap = Capture()

    def add(self, data):
        """Add output a task wrote (from its reader thread)."""
        with self.lock:
            self.cap.add(data)

    def take(self):
        """The output not read yet, as a Capture; the next read starts empty."""
        with self.lock:
            cap, self.cap = self.cap, Capture()
        return cap

    def recent(self):
        """The last few KB of unread output, as text (what wait_for looks at)."""
        with self.lock:
            return bytes(self.cap.tail[-8192:]).decode("utf-8", "replace")


class Task:
    """A running command read by its own thread: a foreground bash command (which is
    handed off to the background when it outlives --handoff) or a background task.
    Its process, unread output and, once done, its ending. An interactive one takes
    input: `stdin` is 'pipe' or 'tty' (else 'null'). `limit` words what its deadline
    is, for its status; `marker` is the cwd sentinel a foreground command's output
    ends with, which take() removes (the cwd it names kept as `cwd`)."""

    def __init__(self, command, proc, limit, stdin="null"):
        # its id: a handle only whoever was given it can use
        self.id = "task_%s" % os.urandom(8).hex()
        self.command, self.proc, self.limit, self.stdin = command, proc, limit, stdin
        self.input_lock = threading.Lock()
        self.out, self.err = Unread(), Unread()
        self.started = time.monotonic()
        self.stop = threading.Event()
        self.done = threading.Event()
        self.why = self.marker = self.cwd = None

    def start(self, deadline, on_output=None):
        """Read the command until it ends, its group killed at `deadline` (monotonic) or on stop."""
        def run():
            try:
                self.why = pump(self, deadline, on_output)
            finally:
                self.done.set()
        threading.Thread(target=run, daemon=True, name="boris-task").start()

    def follow(self, session, cancelled, handoff):
        """Wait for a foreground command of `session`: until it ends ('' then, or why it
        stayed in the foreground when it was due for hand-off), until `cancelled` (it is
        killed: TERM, then KILL), or until `handoff` seconds from its start (None: never),
        when it becomes a background task of the session (None then). It cannot be one
        while the session's background limit is full or the session is closing."""
        kept = ""
        try:
            while not self.done.wait(0.05):
                if cancelled.is_set():
                    self.stop.set()
                    continue
                if handoff is None or kept or time.monotonic() - self.started < handoff:
                    continue
                kept = session.add_task(self)
                if not kept:
                    return None
            return kept
        finally:
            session.hold_foreground(self.proc, False)

    def take(self):
        """(stdout, stderr): the output not read yet, as Captures; the next read starts empty."""
        out, err = self.out.take(), self.err.take()
        if self.marker is not None:
            self.cwd = out.strip_sentinel(self.marker) or self.cwd
        return out, err

    def write(self, data, deadline):
        """Give the task `data` as its input (through the terminal's line discipline on
        a tty: Ctrl-C is an interrupt there); OSError when it cannot take it by `deadline`."""
        with self.input_lock:
            f = self.proc.stdout if self.stdin == "tty" else self.proc.stdin
            if f is None or f.closed:
                raise OSError(errno.EPIPE, "its input is closed")
            fd = f.fileno()
            view = memoryview(data)
            while view:
                left = deadline - time.monotonic()
                if left <= 0 or not ready([fd], left, write=True):
                    raise OSError(errno.ETIMEDOUT, "it took %d of %d bytes and reads no more" % (
                        len(data) - len(view), len(data)))
                view = view[os.write(fd, view[:65536]):]

    def close_input(self):
        """End of input: the pipe closed, or Ctrl-D on a terminal."""
        if self.stdin == "tty":
            self.write(b"\x04", time.monotonic() + 5)
            return
        with self.input_lock:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()


def kill_all(tasks):
    """Stop every task at once, then wait for each (grace period shared, not summed)."""
    for t in tasks:
        t.stop.set()
    for t in tasks:
        t.done.wait(KILL_GRACE_S + 2)

###############################################################################
# Language servers ############################################################
###############################################################################
# The verdict after an edit. A language server found on PATH by its usual name (or named
# by --lsp) starts, one per language and workspace root and shared by the sessions, when
# a file of its language is first viewed or outlined. It runs as a command does
# (start_process: its own process group, the sandbox, no secrets in its environment),
# through the launcher, which ties it to boris's death (PR_SET_PDEATHSIG). A thread per
# server starts it (the kernel ties it to that thread) and reads it: it answers the
# server's requests (unanswered, pyright never publishes), keeps each document's latest
# diagnostics, drops a report for an older version than the latest change, and restarts a
# server that ended once. An edit compares the file's diagnostics before and after by
# (source, code, message) counts, not positions (inserted lines shift every line below),
# waiting --lsp-wait seconds at most; what comes later goes with the next edit's answer.

# language: "its extensions|its usual servers|..." (the first on PATH wins); clangd's
# background index would land in the workspace (.cache/clangd)
LSP_LANGUAGES = {
    "python": "py pyi|pyright-langserver --stdio|basedpyright-langserver --stdio|pylsp",
    "typescript": "ts tsx js jsx mjs cjs|typescript-language-server --stdio",
    "c": "c h cc cpp cxx hpp|clangd --background-index=false",
    "go": "go|gopls", "rust": "rs|rust-analyzer", "shell": "sh bash|bash-language-server start"}
# extension: its languageId, where that is not its language's name
LSP_IDS = {"tsx": "typescriptreact", "js": "javascript", "jsx": "javascriptreact",
           "mjs": "javascript", "cjs": "javascript", "sh": "shellscript", "bash": "shellscript"}
LSP_IDLE_S = 1800                          # a server unused this long is stopped
LSP_MAX_RSS = 2 << 30                      # a server whose process group holds more is stopped
LSP_MAX_MESSAGE = 64 << 20                 # a longer message from a server is garbage
LSP_SHOWN = 5                              # new problems an answer names at most


def lsp_uri(real):
    """The file: URI of a real path."""
    import pathlib
    return pathlib.Path(real).as_uri()


def lsp_read(f):
    """The next message on a server's stdout; None at its end; ValueError for one without a
    usable Content-Length or that is no JSON (garbage: its reader takes any error so)."""
    length = 0
    while True:
        line = f.readline(1024)
        if not line:
            return None
        if not line.strip():
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if not 0 < length <= LSP_MAX_MESSAGE:
        raise ValueError("a message without a usable Content-Length")
    return json.loads(f.read(length))


def group_rss(pgid):
    """Bytes resident in process group `pgid` (0 where /proc cannot tell)."""
    total = 0
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
            total += int(fields[21]) * (int(fields[2]) == pgid)
        except (OSError, ValueError, IndexError):
            continue                        # not a process, or gone meanwhile
    return total * os.sysconf("SC_PAGE_SIZE")


class LangServer:
    """One language server for a language and a root: its process (started, restarted once,
    read by its own thread), and of its current life the queue of what it is to be told, the
    documents it was told of ({uri: [version, text]}) and the diagnostics it gave for each
    since its last change ({uri: list})."""

    def __init__(self, argv, lang, root, owner):
        self.argv, self.lang, self.root, self.owner = argv, lang, root, owner   # its LangServers
        self.cond = threading.Condition()
        self.owed, self.answers, self.ids, self.proc, self.closed = {}, {}, 0, None, False
        self.lives, self.used, self.pull = 2, time.monotonic(), False
        self.name = os.path.basename(argv[0])
        self.next_life()
        threading.Thread(target=self.run, daemon=True, name="boris-lsp").start()

    def next_life(self):
        """A new life's queue, initialize and initialized first (its writer sends the rest
        once initialize is answered: what is said before waits there), no documents."""
        self.out, self.ready, self.docs, self.reports = queue.Queue(), threading.Event(), {}, {}
        self.write({"id": 0, "method": "initialize", "params": {
            "processId": os.getpid(), "rootUri": lsp_uri(self.root), "capabilities": {
                "textDocument": {"publishDiagnostics": {"versionSupport": True},
                                 "diagnostic": {}}}}})
        self.write({"method": "initialized", "params": {}})

    def run(self):
        """Start the server, read it to its end, start it once more after a crash."""
        while self.lives and not self.closed:
            self.lives -= 1
            why = self.serve()
            if not self.closed:
                log("warn", "language server %s ended (%s); %s"
                    % (self.name, why, "restarted" if self.lives else "given up"))
        with self.cond:
            self.closed = True                      # what waits for it waits no more
            self.cond.notify_all()

    def serve(self):
        """One life of the server: start it, say initialize, take its messages until its end
        or garbage; then its group is killed and reaped. Why it ended, in words."""
        try:
            proc = start_process(self.argv, self.root, self.owner.sandbox, "pipe", dict(
                command_environ(self.owner.config), PYTHONDONTWRITEBYTECODE="1"), True)
        except OSError as e:
            self.lives = 0
            return "it could not start: %s" % e
        with self.cond:
            self.proc, out, ready = proc, self.out, self.ready
        for target, args in ((lsp_drain, (proc.stderr,)), (lsp_write, (proc.stdin, out, ready))):
            threading.Thread(target=target, args=args, daemon=True, name="boris-lsp").start()
        try:
            for msg in iter(lambda: lsp_read(proc.stdout), None):
                self.take(msg)
            return "its output ended"
        except Exception as e:              # whatever it sent, boris goes on
            return "it spoke garbage: %s" % shorten(str(e), 80)
        finally:
            out.put(None)
            ready.set()                             # its writer waits no more
            kill_group(proc)
            kill_marked(proc.boris_call)
            with self.cond:
                self.proc = None
                self.next_life()

    def write(self, msg):
        """Queue a message for the server (its writer thread sends it: a server that reads
        nothing stalls no one)."""
        body = json.dumps(dict(msg, jsonrpc="2.0")).encode("utf-8", "surrogateescape")
        self.out.put(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def take(self, msg):
        """One message from the server: its request answered (null, or a null per
        configuration item), a document's diagnostics kept, a response kept."""
        method, rid, params = msg.get("method"), msg.get("id"), msg.get("params")
        if method is not None and rid is not None:
            self.write({"id": rid, "result": [None] * len(params["items"])
                        if method == "workspace/configuration" else None})
            return
        with self.cond:
            if method == "textDocument/publishDiagnostics":
                self.report(params["uri"], params.get("version"), params["diagnostics"])
            elif rid == 0:
                self.pull = "diagnosticProvider" in msg["result"]["capabilities"]
                self.ready.set()
            elif rid in self.answers:
                self.answers[rid] = msg.get("result") or []
            self.cond.notify_all()

    def request(self, method, params, wait):
        """The server's answer to a request ([] for null or an error), None when it gave
        none in `wait` seconds."""
        with self.cond:
            self.ids += 1
            rid, self.answers[self.ids] = self.ids, None
            self.write({"id": rid, "method": method, "params": params})
            self.cond.wait_for(lambda: self.answers[rid] is not None or self.closed, wait)
            return self.answers.pop(rid)

    def report(self, uri, version, diagnostics):
        """Keep a document's errors and warnings (errors first; not those tagged
        "unnecessary"), unless they are for an older version than its latest."""
        doc = self.docs.get(uri)
        if doc is not None and (version is None or version >= doc[0]):
            kept = [d for d in diagnostics
                    if lsp_severity(d) <= 2 and 1 not in (d.get("tags") or ())]
            self.reports[uri] = sorted(kept, key=lsp_severity)[:1000]

    def diagnostics(self, real, text, deadline):
        """The server's diagnostics for file `real` holding `text` (sent as didOpen or
        didChange when it is not what the server has; pulled where the server offers that),
        waited for until `deadline`; None when none came since the change by then."""
        uri = lsp_uri(real)
        with self.cond:
            self.used, doc = time.monotonic(), self.docs.get(uri)
            if doc is None:
                self.docs[uri] = doc = [1, text]
                self.write({"method": "textDocument/didOpen", "params": {"textDocument": {
                    "uri": uri, "version": 1, "text": text, "languageId": LSP_IDS.get(
                        os.path.splitext(real)[1][1:].lower(), self.lang)}}})
            elif doc[1] != text:
                doc[0], doc[1] = doc[0] + 1, text
                self.reports.pop(uri, None)
                self.write({"method": "textDocument/didChange", "params": {
                    "textDocument": {"uri": uri, "version": doc[0]},
                    "contentChanges": [{"text": text}]}})
            version = doc[0]
            if self.pull and uri not in self.reports:
                got = self.request("textDocument/diagnostic", {"textDocument": {"uri": uri}},
                                   deadline - time.monotonic())
                if got and "items" in got:
                    self.report(uri, version, got["items"])
            self.cond.wait_for(lambda: uri in self.reports or self.closed,
                               deadline - time.monotonic())
            return self.reports.get(uri)

    def close(self):
        """Stop the server: its whole process group (its reader then reaps it)."""
        with self.cond:
            self.closed = True
            if self.proc is not None:
                signal_group(self.proc, signal.SIGKILL)


def lsp_drain(f):
    """Read a server's stderr to its end: unread, it would fill and stall the server."""
    while f.read1(65536):
        pass


def lsp_write(f, out, ready):
    """Send a server its queued messages until None (its end), or its stdin breaks; after
    the first (initialize), nothing until `ready` is set (it is answered)."""
    try:
        for data in iter(out.get, None):
            f.write(data)
            f.flush()
            ready.wait()
    except (OSError, ValueError):
        pass                                        # the server is gone: its reader says why


def lsp_severity(diagnostic):
    """1 (error), 2 (warning), 3 (information) or 4 (hint); an error where it is not said."""
    return diagnostic.get("severity") or 1


def lsp_words(name, shown, before, after):
    """The lines an answer gets from a file's kept diagnostics (LangServer.report) before
    and after a change: the problems new by (source, code, message) counts, errors first,
    warnings only while few, at most LSP_SHOWN (the count says how many more); and how
    many went."""
    def key(d):
        return d.get("source"), str(d.get("code")), d.get("message")
    old, fresh = Counter(map(key, before)), []
    for d in reversed(after):               # of equal ones, the last are taken for the old
        if old[key(d)] > 0:
            old[key(d)] -= 1
        else:
            fresh.insert(0, d)
    gone = sum(old.values())
    counts = [plural(len(fresh), "new problem")] if fresh else []
    if gone:
        counts.append("%d fixed" % gone)
    if not counts:
        return ""
    lines = ["[%s on %s: %s]" % (name, shown, "; ".join(counts))] + ["  %d:%d %s [%s] %s" % (
        d["range"]["start"]["line"] + 1, d["range"]["start"]["character"] + 1,
        "error" if lsp_severity(d) == 1 else "warning", d.get("source") or name,
        shorten(" ".join(str(d.get("message")).split()), 300)) for d in fresh[:LSP_SHOWN]]
    return "".join("\n" + line for line in lines)


class LangServers:
    """The language servers of one McpServer, by (language, root), started on first use;
    nothing at start-up."""

    def __init__(self, config, policy, sandbox):
        self.config, self.sandbox = config, sandbox
        self.roots = policy.allow or [policy.workdir]
        self.given = dict.fromkeys(LSP_LANGUAGES, "") if "off" in config.lsp else dict(
            item.partition("=")[::2] for item in config.lsp)
        self.servers, self.lock = {}, threading.Lock()

    def command(self, lang):
        """The argv of the server for `lang` (--lsp, else the first usual one on PATH), or None."""
        import shlex
        import shutil
        for line in self.given.get(lang, LSP_LANGUAGES[lang].partition("|")[2]).split("|"):
            argv = shlex.split(line)
            path = argv and shutil.which(argv[0])
            if path:
                return [path] + argv[1:]
        return None

    def server(self, real):
        """The server for file `real`, started when new; None without one."""
        ext = os.path.splitext(real)[1][1:].lower()
        lang = next((k for k, v in LSP_LANGUAGES.items() if ext in v.split("|")[0].split()), None)
        root = next((r for r in self.roots if is_within(real, r)), None)
        argv = lang and root and self.command(lang)
        if not argv:
            return None
        with self.lock:
            for key, s in list(self.servers.items()):
                if time.monotonic() - s.used > LSP_IDLE_S:
                    s.close()
                    del self.servers[key]
            if (lang, root) not in self.servers:
                self.servers[lang, root] = LangServer(argv, lang, root, self)
            return self.servers[lang, root]

    def warm(self, real):
        """Tell the server of file `real` (a view or outline of it) its text: it starts when
        new. That text; None without a server or where the file cannot be read."""
        s = self.server(real)
        try:
            text = s and read_regular(real, real, self.config.max_file_size)[0].decode(
                "utf-8", "replace")
        except (OSError, ToolError):
            return None                 # the tool says what is wrong with it (too large, a FIFO)
        if s:
            s.diagnostics(real, text, 0)
        return text

    def places(self, real, word, line):
        """[(kind, path, line)] of the definition and references the server of file `real`
        gives for the name at regex `word`'s first match from line `line` (from 1), each
        waited for --lsp-wait seconds; None without a server, the name or its answers."""
        from urllib.parse import unquote
        lines, places = (self.warm(real) or "").split("\n"), []     # "" without a server
        n = next((n for n in range(line - 1, len(lines)) if word.search(lines[n])), None)
        if n is None:
            return None
        for kind in ("definition", "references"):
            got = self.server(real).request("textDocument/" + kind, {
                "textDocument": {"uri": lsp_uri(real)}, "context": {"includeDeclaration": False},
                "position": {"line": n, "character": word.search(lines[n]).start()}},
                self.config.lsp_wait)
            if got is None:
                return None
            places += [(kind, unquote(at["uri"][7:]), at["range"]["start"]["line"] + 1)
                       for at in ([got] if isinstance(got, dict) else got)]
        return places

    def verdicts(self, todo):
        """What an edit's answer ends with: for each file it wrote, the problems it brought
        in (and fixed) by its server, waited for --lsp-wait seconds in all."""
        deadline, said = time.monotonic() + self.config.lsp_wait, []
        for real, shown, data, before, _ in todo:            # FileEdit records
            s = data is not None and self.server(real)
            if not s:
                continue
            proc = s.proc
            if proc is not None and group_rss(proc.pid) > LSP_MAX_RSS:
                signal_group(proc, signal.SIGKILL)     # over the bound: restarted once
            base = [] if before is None else s.diagnostics(
                real, before.decode("utf-8", "replace"), deadline)
            owed = s.owed.pop(real, None)
            if owed is not None and base is not None:       # the edit before's, come late
                said.append(lsp_words(s.name, shown + " (the edit before)", owed, base))
            base = owed if base is None else base
            after = s.diagnostics(real, data.decode("utf-8", "replace"), deadline)
            if after is None:
                s.owed[real] = base                 # (None: nothing to compare with later)
                said.append("\n[%s on %s: not known yet; said with the next edit's answer]"
                            % (s.name, shown))
            elif base is not None:
                said.append(lsp_words(s.name, shown, base, after))
        return "".join(said)

    def close(self):
        """Stop every server."""
        with self.lock:
            for s in self.servers.values():
                s.close()
            self.servers.clear()


###############################################################################
# Web #########################################################################
###############################################################################
# urllib and html.parser are imported inside these functions: start-up never pays.

HTML_SKIP = frozenset(("script", "style", "noscript", "template", "svg", "head", "iframe",
                       "object"))
HTML_BLOCKS = frozenset(("p", "div", "section", "article", "header", "footer", "nav", "main",
                         "aside", "form", "dl", "dt", "dd", "figure", "figcaption", "body", "html",
                         "details", "summary", "address", "center", "fieldset", "legend", "hgroup",
                         "search", "caption"))
HTML_VOID = frozenset(("br", "img", "hr", "input", "meta", "link", "area", "base", "col", "embed",
                       "param", "source", "track", "wbr"))
# elements nested deeper are read as their parent's content
HTML_DEPTH = 200
# rendered as blocks of their own
HTML_BLOCK_TAGS = HTML_BLOCKS | frozenset(("ul", "ol", "li", "pre", "table", "blockquote", "hr",
                                           "h1", "h2", "h3", "h4", "h5", "h6"))
# a start tag -> the open ones it ends (a block but li: an open paragraph too)
HTML_IMPLIED_ENDS = {"li": ("li",), "p": ("p",), "dt": ("dt", "dd", "p"), "dd": ("dt", "dd", "p"),
                     "tr": ("tr", "td", "th"), "td": ("td", "th"), "th": ("td", "th"),
                     "option": ("option",)}
HTML_IMPLIED_ENDS = dict({tag: ("p",) for tag in HTML_BLOCK_TAGS}, **HTML_IMPLIED_ENDS)


# -- HTML to Markdown -------------------------------------------------------------
# An element of the page as HtmlToMarkdown reads it (its text children are str)
HtmlNode = namedtuple("HtmlNode", "tag attrs children")


class HtmlToMarkdown:
    """A page's visible content as Markdown a model reads as the page means it: headings
    '#', lists '- ' and '1. ' (numbered from `start`) with an item's blocks indented under
    it, blockquotes '> ', <pre> fenced (a fence longer than any backtick run inside), links
    [text](absolute url), inline `code`, table rows '| a | b |', rules '* * *'; page text that
    would read as Markdown structure is escaped; script, style and the like dropped, blank
    space folded.

    html_to_markdown mixes this class into html.parser's HTMLParser (imported there: start-up
    never pays), whose handlers below build the page as a tree of HtmlNodes, end tags
    implied as browsers imply them for li, p, dt, dd, tr, td, th and option;
    markdown() then renders that tree."""

    def __init__(self, base_url):
        super().__init__()                      # (character references converted)
        self.base_url = base_url
        self.root = HtmlNode("#root", {}, [])
        self.stack, self.title, self.skip, self.in_title = [self.root], [], 0, False

    # -- the page as a tree ------------------------------------------------------
    def handle_starttag(self, tag, attrs):
        if tag == "title":
            self.in_title = True
            return
        if tag in HTML_SKIP or self.skip:
            self.skip += tag in HTML_SKIP and tag not in HTML_VOID
            return
        closes = HTML_IMPLIED_ENDS.get(tag, ())
        while self.stack[-1].tag in closes:
            self.stack.pop()
        node = HtmlNode(tag, dict(attrs), [])
        self.stack[-1].children.append(node)
        if tag not in HTML_VOID and len(self.stack) < HTML_DEPTH:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if self.stack[-1].tag == tag:       # (void elements and #root never stand on the stack)
            self.stack.pop()

    def handle_endtag(self, tag):
        if tag == "title":
            self.in_title = False
            return
        if self.skip:
            self.skip -= tag in HTML_SKIP
            return
        for k in range(len(self.stack) - 1, 0, -1):
            if self.stack[k].tag == tag:
                del self.stack[k:]
                return

    def handle_data(self, data):
        if self.in_title:
            self.title.append(data)
        elif not self.skip:
            self.stack[-1].children.append(data)

    # -- the tree as Markdown ----------------------------------------------------
    def markdown(self, markup):
        """The Markdown of `markup`: its title as a heading (unless the body starts with
        it), then its body."""
        try:
            self.feed(markup)
            self.close()
        except Exception:                    # html.parser is lenient; never let a page crash a call
            pass
        try:
            body = self.blocks(self.root.children)
        except RecursionError:
            body = " ".join(html_text(self.root).split())
        body = re.sub(r"\n{3,}", "\n\n", body).strip()
        title = " ".join("".join(self.title).split())
        heading = title and title not in body[:len(title) + 4]
        return ("# %s\n\n%s" % (title, body)).strip() if heading else body

    def destination(self, href):
        """A link's absolute URL, written so it stays one link: spaces and parentheses encoded."""
        import urllib.parse
        url = urllib.parse.urljoin(self.base_url, href)
        return url.replace(" ", "%20").replace("(", "%28").replace(")", "%29")

    def inline(self, nodes, pre=False, in_link=False):
        """The inline content of `nodes` as one string (whitespace folded unless pre; a
        link's own text with its brackets escaped)."""
        out = []
        for c in nodes:
            if isinstance(c, str):
                text = c if pre else re.sub(r"\s+", " ", c)
                out.append(text.replace("[", "\\[").replace("]", "\\]") if in_link else text)
                continue
            tag, attrs, children = c
            if tag == "br":
                out.append("\n")
            elif tag == "a":
                out.append(self.link(attrs, children))
            elif tag in ("code", "kbd", "samp", "tt") and not pre:
                out.append(markdown_code(html_text(c)))
            elif tag == "img":
                out.append(self.image(attrs))
            elif tag in ("td", "th"):
                out.append(" %s |" % self.inline(children).strip())
            else:
                out.append(self.inline(children, pre))
        return "".join(out)

    def link(self, attrs, children):
        """An a element: [its text](its absolute href), the spaces at its edges kept outside;
        its text alone without an href, or with one to this page or to script."""
        text = self.inline(children, in_link=True)
        href = (attrs.get("href") or "").strip()
        core = " ".join(text.split())
        if core and href and not href.startswith(("#", "javascript:")):
            text = "%s[%s](%s)%s" % (" " * text[:1].isspace(), core, self.destination(href),
                                     " " * text[-1:].isspace())
        return text

    def image(self, attrs):
        """An img element: ![its alt text](its absolute src), its alt text alone without a src
        (or with a data: one)."""
        alt = " ".join((attrs.get("alt") or "").split())
        alt = alt.replace("[", "\\[").replace("]", "\\]")
        src = (attrs.get("src") or "").strip()
        if src and not src.startswith("data:"):
            return "![%s](%s)" % (alt, self.destination(src))
        return alt

    def blocks(self, nodes, item=False):
        """Markdown of a sequence of block and inline nodes: runs of inline content become
        paragraphs; blocks are separated by blank lines, except (in a list item) a list
        right after the item's own text, which follows it on the next line."""
        parts = []
        # (text has no tag: inline)
        runs = groupby(nodes, lambda c: getattr(c, "tag", None) not in HTML_BLOCK_TAGS)
        for is_inline, run in runs:                # inline content, or blocks
            if is_inline:
                text = "\n".join(line.strip() for line in self.inline(run).split("\n")).strip()
                if text:
                    parts.append(("text", markdown_escaped(text)))
                continue
            for c in run:
                md = self.block(c)
                if md.strip():
                    parts.append((c.tag, md))
        out, before = "", None
        for kind, md in parts:
            tight = item and kind in ("ul", "ol") and before == "text"
            out += ("\n" if tight else "\n\n" if out else "") + md
            before = kind
        return out

    def block(self, node):
        """Markdown of one block node."""
        tag, attrs, children = node
        if tag in ("h1", "h2", "h3", "h4", "h5", "h6"):
            text = " ".join(self.inline(children).split())
            return "%s %s" % ("#" * int(tag[1]), text) if text else ""
        if tag == "pre":
            code = html_text(node).strip("\n")
            run = max(map(len, re.findall(r"`{3,}", code)), default=2)
            fence = "`" * (run + 1)
            lines = "\n".join(line.rstrip() for line in code.split("\n"))
            return "%s\n%s\n%s" % (fence, lines, fence)
        if tag in ("ul", "ol"):
            return self.list_block(tag, attrs, children)
        if tag == "blockquote":
            body = self.blocks(children)
            return "\n".join("> " + line if line else ">" for line in body.split("\n"))
        if tag == "hr":
            return "* * *"
        if tag == "table":
            rows = ([" ".join(self.inline(cell.children).split()) for cell in row]
                    for row in table_rows(node))
            return "\n".join("| %s |" % " | ".join(cells) for cells in rows)
        return self.blocks(children)

    def list_block(self, tag, attrs, children):
        """A ul or ol: '- ' or numbered items (from `start`), an item's blocks indented under
        its marker, loose (blank lines between) when any item holds paragraphs."""
        items, number = [], 1
        try:
            number = int(attrs.get("start") or 1)      # (a ul's number is never shown)
        except ValueError:
            pass                            # numbered from 1
        loose = False
        for c in children:
            marker = "- " if tag == "ul" else "%d. " % number
            if isinstance(c, str):
                if c.strip():
                    items.append((marker, c.strip()))
                continue
            if c.tag != "li":
                md = self.block(c) if c.tag in HTML_BLOCK_TAGS else self.inline([c]).strip()
                if not md:
                    continue
                if c.tag in ("ul", "ol") and items and items[-1][0]:
                    # a list put straight in a list: the item before holds it
                    items[-1] = (items[-1][0], items[-1][1] + "\n" + md)
                else:
                    items.append(("", md))
                continue
            number += tag == "ol"
            body = self.blocks(c.children, item=True)
            loose |= "\n\n" in body
            items.append((marker, body))
        return ("\n\n" if loose else "\n").join(list_item(*item) for item in items)



def list_item(marker, body):
    """A list item's Markdown: its body after its marker, the lines below indented under it."""
    pad = " " * len(marker)
    return "\n".join((pad + line if line.strip() else "") if k else marker + line
                     for k, line in enumerate(body.split("\n"))).rstrip()


def html_text(node):
    """The text of `node` and all below it, as it stands."""
    return "".join(c if isinstance(c, str) else html_text(c) for c in node.children)


def markdown_code(code):
    """Inline code in backticks, more of them than any run inside (none for blank code)."""
    if not code.strip():
        return ""
    tick = "`" * (max(map(len, re.findall(r"`+", code)), default=0) + 1)
    pad = " " if code.startswith("`") or code.endswith("`") else ""
    spaced = re.sub(r"\s+", " ", code.strip())
    return "%s%s%s%s%s%s%s" % (" " * code[:1].isspace(), tick, pad, spaced, pad, tick,
                               " " * code[-1:].isspace())


def markdown_escaped(text):
    """Paragraph text whose line starts would read as Markdown structure, escaped."""
    lines = text.split("\n")
    for k, line in enumerate(lines):
        m = re.match(r"^(\s*)(#{1,6}(?=\s|$)|>|[-+*](?=\s|$)|\d{1,9}[.)](?=\s|$)"
                     r"|(?:[-*_] *){3,}$|=+\s*$|```|~~~)", line)
        if m:                                       # a backslash before the mark, or 1\. for 1.
            at = m.end() - 1 if m.group(2)[0].isdigit() else m.end(1)
            lines[k] = line[:at] + "\\" + line[at:]
    return "\n".join(lines)


def table_rows(node):
    """The rows of a table node (in thead, tbody or tfoot too), each a list of its cells."""
    rows = []
    for c in node.children:
        tag = getattr(c, "tag", None)                   # (text has none)
        if tag == "tr":
            rows.append([cell for cell in c.children if getattr(cell, "tag", None) in ("td", "th")])
        elif tag in ("thead", "tbody", "tfoot"):
            rows += table_rows(c)
    return rows


def html_to_markdown(markup, base_url=""):
    """A page's visible content as Markdown (see HtmlToMarkdown); `base_url` makes its links
    absolute."""
    from html.parser import HTMLParser
    return type("HtmlParser", (HtmlToMarkdown, HTMLParser), {})(base_url).markdown(markup)


# -- fetching ---------------------------------------------------------------------
def address_refusal(address, block_private=False):
    """Why web_fetch must not connect to the IP `address`, or None. Link-local
    addresses (169.254.0.0/16, fe80::/10: cloud metadata services) are always refused;
    with block_private also loopback, private, unspecified, multicast and reserved."""
    import ipaddress
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return "not an IP address"  # a name, not an address: the caller treats it as such
    ip = getattr(ip, "ipv4_mapped", None) or ip         # (an address is never false)
    if ip.is_link_local:
        return "a link-local address (cloud metadata services live there)"
    if block_private and (ip.is_loopback or ip.is_private or ip.is_unspecified or ip.is_multicast
                          or ip.is_reserved):
        return "a loopback or private address (--web-fetch-block-private)"
    return None


class FetchWatch:
    """The deadline and cancellation of one fetch: when either comes, every socket it
    opened is shut down, so a blocked read returns at once whatever the server does."""

    def __init__(self, timeout, cancelled):
        self.deadline = time.monotonic() + timeout
        self.cancelled = cancelled
        self.sockets = []
        self.fired = threading.Event()
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self.done.is_set():
            left = self.deadline - time.monotonic()
            if left <= 0 or self.cancelled.is_set():
                self.fired.set()
                for sock in list(self.sockets):
                    try:
                        sock.shutdown(2)
                    except OSError:
                        pass  # already closed
                return
            self.done.wait(min(left, 0.05))

    def left(self):
        """Seconds left of the whole fetch (at least 0.01)."""
        return max(0.01, self.deadline - time.monotonic())


# What can go wrong, by kind: (code, message). A fetch_error carries its kind and
# facts as its detail, so a tool can word it its own way (web_fetch: fixed Chinese).
FETCH_ERRORS = {
    "content_type": (IO_ERROR, "the content type %(ctype)s is not text: %(url)s"),
    "beyond": (INVALID_INPUT,
               "start_index %(start)d is past the end of the text (%(length)d characters)"),
    "timeout": (IO_ERROR, "the request timed out (%(timeout)ss): %(url)s"),
    "redirect_scheme": (IO_ERROR,
                        "a redirect to a scheme other than http or https: %(target)s: %(url)s"),
    "unresolved": (IO_ERROR, "the host %(host)s could not be resolved: %(url)s"),
    "refused": (ACCESS_DENIED, "refused to connect to %(host)s (%(address)s is %(why)s): %(url)s"),
    "redirects": (IO_ERROR, "too many redirects (over %(max)d): %(url)s"),
    "status": (IO_ERROR, "HTTP %(status)d: %(url)s"),
    "connection_refused": (IO_ERROR, "the connection was refused: %(url)s"),
    "failed": (IO_ERROR, "the request failed (%(reason)s): %(url)s"),
    "scheme": (IO_ERROR, "only http and https URLs are fetched: %(url)s"),
    "url_long": (INVALID_INPUT, "the URL is over %(max)d characters: %(url)s"),
    "url_space": (INVALID_INPUT, "a space or control character at %(at)d of the URL: percent-encode"
                                 " it, e.g. %%20: %(url)s"),
    "url_malformed": (INVALID_INPUT, "a malformed URL (%(reason)s): %(url)s"),
    "url_no_host": (INVALID_INPUT, "the URL has no host name: %(url)s"),
    "url_port_zero": (INVALID_INPUT, "port 0 is not a port: %(url)s"),
    "url_idna": (INVALID_INPUT, "the host name %(host)s cannot be IDNA-encoded: %(url)s"),
    "not_allowed": (ACCESS_DENIED, "%(host)s is not among the domains web_fetch may reach"
                                   " (--web-fetch-allow: %(allowed)s): %(url)s"),
}


def fetch_error(kind, **facts):
    """The ToolError of a fetch that failed for `kind` (FETCH_ERRORS), its detail (kind, facts)."""
    code, message = FETCH_ERRORS[kind]
    return ToolError(code, message % facts, detail=(kind, facts))


class WebFetch:
    """One web_fetch of `url` (as the model gave it; every error names it so): the URL
    checked, a GET that connects only to vetted addresses (checked after DNS, on every
    redirect too), its text. Every failure is a fetch_error."""

    def __init__(self, url, timeout, cancelled=None, block_private=False, allow=()):
        self.url, self.timeout, self.block_private = url, timeout, block_private
        # --web-fetch-allow: the only hosts it may reach
        self.allow = [a.lower().rstrip(".") for a in allow]
        self.cancelled = cancelled or threading.Event()

    def text(self, start=0):
        """The readable text of the page (HTML as light Markdown) from `start`, within
        WEB_MAX_CHARS; a cut one ends with the start_index that reads on."""
        ctype, charset, body = self.get()
        url = self.url
        try:
            text = body.decode(text_codec(charset) or "utf-8", "replace")  # (no charset: UTF-8)
        except (UnicodeError, ValueError):
            text = body.decode("utf-8", "replace")
        if ctype in ("text/html", "application/xhtml+xml") or (
                not ctype and text.lstrip()[:1] == "<"):
            text = html_to_markdown(text, url)
        elif not (ctype.startswith("text/")
                  or ctype in ("application/json", "application/xml", "application/javascript")
                  or ctype.endswith(("+json", "+xml")) or not ctype):
            raise fetch_error("content_type", ctype=ctype, url=url)
        if start > len(text):
            raise fetch_error("beyond", start=start, length=len(text))
        if len(text) - start <= WEB_MAX_CHARS:
            return text[start:]
        end = start + WEB_MAX_CHARS - 200                        # room for the notice
        return text[start:end] + (
            "\n\n[已截断：共 %d 字符，已显示 %d-%d；用 start_index=%d 继续 / cut:"
            " characters %d-%d of %d shown; read on with start_index=%d]"
            % (len(text), start, end, end, start, end, len(text), end))

    def get(self):
        """(content_type, charset, body bytes) of a GET of the checked URL. At most
        WEB_MAX_REDIRECTS redirects (http/https only), at most WEB_MAX_BYTES read; the
        timeout bounds the whole call, and `cancelled` ends it at once."""
        import http.client
        import urllib.error
        import urllib.request

        request_url, url, timeout = self.checked(self.url), self.url, self.timeout
        if request_url[:6].lower() == "https:" and not hasattr(http.client, "HTTPSConnection"):
            raise fetch_error("failed", reason="https needs Python's ssl module, which this"
                              " Python was built without", url=url)
        watch = FetchWatch(timeout, self.cancelled)
        opener = self.opener(watch)
        timed_out = fetch_error("timeout", timeout=timeout, url=url)
        try:
            req = urllib.request.Request(request_url, headers={
                "User-Agent": "boris/%s" % __version__,
                "Accept": "text/html,application/json,text/*;q=0.9,*/*;q=0.5"})
            with opener.open(req, timeout=timeout) as resp:
                ctype = resp.headers.get_content_type() if resp.headers.get("Content-Type") else ""
                charset = resp.headers.get_content_charset()
                chunks, size = [], 0
                while size < WEB_MAX_BYTES and not watch.fired.is_set():
                    block = resp.read1(min(65536, WEB_MAX_BYTES - size))
                    if not block:
                        break
                    chunks.append(block)
                    size += len(block)
                if watch.fired.is_set():
                    raise timed_out
                return ctype, charset, b"".join(chunks)
        except ToolError:
            raise
        except (urllib.error.URLError, OSError, ValueError) as e:
            if isinstance(e, urllib.error.HTTPError):
                e.close()                   # an error response holds its socket until closed
            raise self.error(e, watch.fired.is_set(), timed_out)
        finally:
            watch.done.set()                    # the fetch is over: end the watch
            for sock in watch.sockets:
                sock.close()

    def opener(self, watch):
        """A urllib opener whose connections go only to vetted addresses (checked after
        DNS, on every redirect too), registered with `watch`, redirects bounded."""
        import http.client
        import socket
        import urllib.parse
        import urllib.request
        fetch = self

        def connect(conn):
            host = conn._tunnel_host or conn.host
            error = OSError("could not connect to %s" % conn.host)
            for family, kind, proto, _, address in fetch.vetted(conn.host, conn.port):
                sock = socket.socket(family, kind, proto)
                watch.sockets.append(sock)
                sock.settimeout(watch.left())
                try:
                    sock.connect(address)
                    return sock, host
                except OSError as e:
                    sock.close()
                    error = e
                    if watch.fired.is_set():
                        break
            raise error

        class Plain(http.client.HTTPConnection):
            def connect(self):
                self.sock = connect(self)[0]
                if self._tunnel_host:
                    self._tunnel()

        class PlainHandler(urllib.request.HTTPHandler):
            def http_open(self, req):
                return self.do_open(Plain, req)
        handlers = [PlainHandler]
        if hasattr(http.client, "HTTPSConnection"):     # (a Python built without ssl has none)
            class Secure(http.client.HTTPSConnection):
                def connect(self):
                    sock, host = connect(self)
                    if self._tunnel_host:
                        self.sock = sock
                        self._tunnel()
                        sock = self.sock
                    self.sock = self._context.wrap_socket(sock, server_hostname=host)

            class SecureHandler(urllib.request.HTTPSHandler):
                def https_open(self, req):
                    return self.do_open(Secure, req, context=self._context)
            handlers.append(SecureHandler)

        class Redirects(urllib.request.HTTPRedirectHandler):
            max_redirections = WEB_MAX_REDIRECTS

            def redirect_request(self, req, fp, code, msg, headers, newurl):
                if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
                    fp.close()
                    raise fetch_error("redirect_scheme", target=newurl, url=fetch.url)
                return super().redirect_request(req, fp, code, msg, headers, newurl)

        return urllib.request.build_opener(Redirects, *handlers)

    def vetted(self, host, port):
        """getaddrinfo of `host`, every address checked; a fetch_error otherwise (also for a
        host the --web-fetch-allow list does not name, before it is resolved)."""
        import socket
        if self.allow and not host_allowed(host, self.allow):
            raise fetch_error("not_allowed", host=host, allowed=", ".join(self.allow), url=self.url)
        try:
            infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise fetch_error("unresolved", host=host, url=self.url)
        for info in infos:
            address = info[4][0]
            why = address_refusal(address, self.block_private)
            if why:
                log("warn", "web_fetch refused an address", host=host, address=address, reason=why)
                raise fetch_error("refused", host=host, address=address, why=why, url=self.url)
        return infos

    def error(self, e, fired, timed_out):
        """The fetch_error for what urllib raised (`timed_out` when the whole-call
        timeout `fired` or the socket timed out)."""
        import socket
        import urllib.error
        import urllib.parse
        url = self.url
        if isinstance(e, urllib.error.HTTPError):
            if e.code in (301, 302, 303, 307, 308):
                return fetch_error("redirects", max=WEB_MAX_REDIRECTS, url=url)
            return fetch_error("status", status=e.code, url=url)
        reason = getattr(e, "reason", e)
        if isinstance(reason, ToolError):
            return reason
        if fired or isinstance(reason, socket.timeout) or "timed out" in str(reason):
            return timed_out
        if isinstance(reason, socket.gaierror):
            return fetch_error("unresolved", host=urllib.parse.urlsplit(url).hostname, url=url)
        if isinstance(reason, ConnectionRefusedError):
            return fetch_error("connection_refused", url=url)
        return fetch_error("failed", reason=reason, url=url)

    @staticmethod
    def checked(url):
        """`url` ready to request (non-ASCII in the path and query percent-encoded), or a
        fetch_error naming what is wrong with it: not http(s), no host, a port that is
        no number, a malformed IPv6 literal, spaces or control characters."""
        import urllib.parse
        shown = re.sub(r"[\x00-\x1f\x7f]", lambda m: "\\x%02x" % ord(m.group(0)), url[:200]) + \
            ("..." if len(url) > 200 else "")
        if len(url) > MAX_URL_CHARS:
            raise fetch_error("url_long", length=len(url), max=MAX_URL_CHARS, url=shown)
        bad = re.search(r"[\x00-\x20\x7f]", url)
        if bad:
            raise fetch_error("url_space", at=bad.start() + 1, url=shown)
        try:
            parts = urllib.parse.urlsplit(url)
            port, host = parts.port, parts.hostname
        except ValueError as e:
            raise fetch_error("url_malformed", reason=e, url=shown)
        if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
            raise fetch_error("scheme", url=shown)
        if not host:
            raise fetch_error("url_no_host", url=shown)
        if port == 0:
            raise fetch_error("url_port_zero", url=shown)
        try:
            host.encode("idna")
        except UnicodeError:
            raise fetch_error("url_idna", host=host[:100], url=shown)
        safe = "/?#[]@!$&'()*+,;=%~:"
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc,
                                        urllib.parse.quote(parts.path, safe=safe),
                                        urllib.parse.quote(parts.query, safe=safe),
                                        urllib.parse.quote(parts.fragment, safe=safe)))


###############################################################################
# Session #####################################################################
###############################################################################


class Session:
    """One client's state: cwd, sentinel nonce, viewed set, tasks, in-flight calls, undo
    history, checkpoints. What changes (viewed, tasks, inflight, foreground, cwd, closed,
    edits, ended) is changed under `lock`, and read under it too, but for running() (a copy
    of tasks, taken whole under the GIL) and `ended` (one float, read by its checkpoints'
    busy test); `checkpoints` is made once under `lock`, then only read; `client`,
    `last_seen` and `log_level` are single values a transport or a call sets."""

    def __init__(self, config):
        self.config = config
        self.cwd = config.workdir
        self.nonce = os.urandom(12).hex()
        self.lock = threading.Lock()
        self.viewed = {}            # canonical path -> Seen: what this session last saw there
        self.client = ""            # clientInfo.name from initialize
        self.tasks = {}
        self.inflight = {}          # request id -> [threading.Event] (set = cancelled)
        self.ended = 0.0            # when its last call ended (time.monotonic())
        self.foreground = set()     # Popen objects of running foreground commands
        self.closed = False
        self.last_seen = time.monotonic()
        self.log_level = None
        # undo_edit's history, oldest first: (tool, {real: (before, mode, after)})
        self.edits = []
        self.checkpoints = None     # its Checkpoints (McpServer.checkpoints_of, on any call)

    def add_task(self, task):
        """Make `task` one of the session's background tasks; '' when it is, else why
        not (the session is closing, or MAX_BACKGROUND_TASKS are running). With None,
        only whether one could be added now."""
        with self.lock:
            running = len(self.running())
            if self.closed:
                return "the session is closing"
            if running >= MAX_BACKGROUND_TASKS:
                return "%d background tasks are already running, the limit" % running
            if task is not None:
                self.tasks[task.id] = task
            return ""

    def running(self):
        """The background tasks still running (the caller may hold `lock`: it is not taken)."""
        return [t for t in list(self.tasks.values()) if not t.done.is_set()]

    def task(self, task_id):
        """(the task `task_id` or None, the ids of the session's tasks)."""
        with self.lock:
            return self.tasks.get(task_id), sorted(self.tasks)

    def task_list(self):
        """The session's tasks, oldest first."""
        with self.lock:
            return sorted(self.tasks.values(), key=attrgetter("started"))

    def drop_task(self, task):
        """Forget a finished task once its end was read."""
        with self.lock:
            self.tasks.pop(task.id, None)

    def hold_foreground(self, proc, held=True):
        """Note (held) or forget a foreground command's process: close() kills those held."""
        with self.lock:
            (self.foreground.add if held else self.foreground.discard)(proc)

    def remember_edit(self, tool, changes):
        """Note an edit undo_edit can take back: for each path, the bytes before (None:
        it did not exist; a StoredBytes: in the checkpoint store), their mode, and the
        digest after (None: removed). At most UNDO_LEVELS a file and UNDO_MAX_BYTES in
        memory in all: the oldest go first."""
        in_memory = lambda changes: sum(len(before) for before, _, _ in changes.values()
                                        if isinstance(before, bytes))
        with self.lock:
            self.edits.append((tool, changes))
            for real in changes:
                of_file = [(t, c) for t, c in self.edits if real in c]
                if len(of_file) > UNDO_LEVELS:
                    self.edits.remove(of_file[0])
            held = sum(in_memory(c) for _, c in self.edits)
            while held > UNDO_MAX_BYTES and len(self.edits) > 1:
                _, dropped = self.edits.pop(0)
                held -= in_memory(dropped)

    def last_edit(self, real):
        """The latest edit of `real` still to be taken back, or None; and how many there are."""
        with self.lock:
            of_file = [(t, c) for t, c in self.edits if real in c]
        return (of_file[-1] if of_file else None), len(of_file)

    def forget_edit(self, edit):
        """Drop an edit that was taken back."""
        with self.lock:
            if edit in self.edits:
                self.edits.remove(edit)

    def mark_viewed(self, real, seen=None):
        """Note that the session has seen `real` (view, read_file or its own write);
        `seen` is what it held then (a Seen), when known."""
        with self.lock:
            self.viewed[real] = seen

    def has_viewed(self, real):
        """Whether this session has viewed `real`."""
        with self.lock:
            return real in self.viewed

    def seen_of(self, real):
        """The Seen (stat and digest) of `real` when this session last viewed or wrote it,
        or None."""
        with self.lock:
            return self.viewed.get(real)

    def set_cwd(self, path):
        """Set the working directory the next command starts in."""
        with self.lock:
            self.cwd = path

    def get_cwd(self):
        """The session's working directory, or the workdir once it no longer exists."""
        with self.lock:
            cwd = self.cwd
        return cwd if os.path.isdir(cwd) else self.config.workdir

    def begin(self, rid):
        """A cancel event for request `rid`; ids may repeat, each call has its own."""
        ev = threading.Event()
        with self.lock:
            self.inflight.setdefault(rid, []).append(ev)
        return ev

    def end(self, rid, ev):
        """Forget a finished request's cancel event."""
        with self.lock:
            events = self.inflight[rid]
            events.remove(ev)
            if not events:
                del self.inflight[rid]
            self.ended = time.monotonic()

    def busy(self):
        """Whether any call of this session is in flight."""
        with self.lock:
            return bool(self.inflight)

    def settle(self):
        """Give the calls in flight EOF_GRACE_S to end."""
        deadline = time.monotonic() + EOF_GRACE_S
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.01)

    def is_inflight(self, rid):
        """Whether request rid is still running."""
        with self.lock:
            return rid in self.inflight

    def cancel(self, rid):
        """Cancel every in-flight call with id `rid`; False when there is none."""
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            return False
        with self.lock:
            events = list(self.inflight.get(rid, ()))
        for ev in events:
            ev.set()
        return bool(events)

    def close(self):
        """Cancel in-flight calls and kill every background task (TERM, grace, KILL); then give
        the calls EOF_GRACE_S to end, and kill the commands still in the foreground (one a
        call started as the session closed among them)."""
        with self.lock:
            self.closed = True
            events = [ev for evs in self.inflight.values() for ev in evs]
            tasks = list(self.tasks.values())
            self.tasks.clear()
        for ev in events:
            ev.set()
        kill_all(tasks)
        self.settle()
        with self.lock:
            procs = list(self.foreground)
        for proc in procs:
            stop_group(proc)
        if self.checkpoints is not None:
            self.checkpoints.close()


###############################################################################
# Checkpoints #################################################################
###############################################################################
# Before every call that can change files the session has a checkpoint of the workspace:
# each file, symlink and directory the walker lists (ignore rules, .git and node_modules
# left out, as for a search) with its mode and, for a file, the digest of its bytes in
# the server's content-addressed store (or the blob id git's index vouches for). A
# checkpoint is taken by a thread of the session after each such call ends (agents think
# for seconds; the next changing call waits only for what is left): a file is read only
# when its lstat changed and stored only when its bytes are new, and a watched directory
# with no event since it was looked at is not looked at again. rewind puts one back.

# never walked (a workspace of /): no files to keep there
CHECKPOINT_SKIPPED = ("/proc", "/sys", "/dev")
CHECKPOINT_YIELD_S = 0.02                            # how often a scan that gave way looks again
CHECKPOINT_CALM_S = 0.05                             # ... and this long after a call (calls come
#                                                      in bursts, each waiting for the interpreter)
# a walk hands a waiter its part once it ran this long
CHECKPOINT_PART_MIN_S = 0.5
# a walk this big hands freed memory back (trim_memory)
CHECKPOINT_TRIM_ENTRIES = 50000


CHECKPOINT_PREFIX = "boris-checkpoints-"         # a store: <temp>/boris-checkpoints-XXXX, 0700
# a pack file of the store takes bytes up to this size
STORE_PACK_BYTES = 64 << 20
# a store with no lock file yet is being made this long
STORE_MAKING_S = 60
NO_STORE = (
    "no writable place for their store outside the workspace: the temp directory and ~/.cache are"
    " read-only or missing; set TMPDIR (or XDG_CACHE_HOME) to a writable directory to have them")


# -- the store --------------------------------------------------------------------
def hold_store(store):
    """Lock a new store for as long as this process lives (the descriptor returned; None where
    there is no flock): sweep_stores() leaves a store alone while its lock is held. The lock
    file is locked before it takes its name, so it is never seen unlocked while in use."""
    try:
        import fcntl
    except ImportError:
        return None
    tmp = os.path.join(store, "lock.new")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, os.path.join(store, "lock"))
    except BaseException:
        os.close(fd)
        raise
    return fd


def store_bases():
    """The directories a store can be made in: the temp directory and the user's cache
    directory ($XDG_CACHE_HOME, else ~/.cache; its boris/ folder), where there are such."""
    cache = cache_dir()
    return [p for p in (temp_dir(), cache and os.path.join(cache, "boris")) if p]


def fs_type(path):
    """The type of the filesystem `path` is on ('tmpfs', 'ext4', ...), from the mount table
    (Linux); None where it cannot be told."""
    best, kind = "", None
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f.read().decode("utf-8", "surrogateescape").splitlines():
                fields, _, rest = line.partition(" - ")
                mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)),
                               fields.split(" ")[4])
                if is_within(path, mount_point) and len(mount_point) >= len(best) and rest:
                    best, kind = mount_point, rest.split(" ")[0]
    except (OSError, IndexError):
        return None
    return kind


def store_place(roots):
    """Where the server's store is made (store_bases): outside the roots when it can (inside,
    a command could change what a rewind writes back; a workspace of / leaves no choice);
    then never on a RAM-backed tmpfs when another is writable; then on the first root's
    filesystem (the cache directory is, where /tmp is a tmpfs); the temp directory before
    the cache directory. None when no place can be made."""
    try:
        home = os.stat(roots[0]).st_dev if roots else None
    except OSError:
        home = None
    best, best_rank = None, None
    for base in store_bases():
        try:
            os.makedirs(base, 0o700, exist_ok=True)
            st = os.stat(base)
        except OSError:
            continue
        if not os.access(base, os.W_OK | os.X_OK):
            continue                    # (one that is there on a read-only root: no store)
        inside = any(is_within(base, root) for root in roots)
        on_ram = fs_type(base) in ("tmpfs", "ramfs")
        rank = (inside, on_ram, st.st_dev != home)
        if best is None or rank < best_rank:            # on a tie the temp directory stays
            best, best_rank = base, rank
    return best


def sweep_stores():
    """Remove, in the background (the thread returned), the stores that servers killed
    before they could (kill -9, a power cut) left where stores are made: this user's,
    with a lock file (or the one hold_store was making) no process holds, or none at all
    a minute after it was made. A server sweeps once its start-up lines are out."""
    import shutil
    try:
        import fcntl
    except ImportError:
        return None

    def sweep():
        for top in store_bases():
            try:
                names = [n for n in os.listdir(top) if n.startswith(CHECKPOINT_PREFIX)]
            except OSError:
                continue
            for name in names:
                sweep_one(os.path.join(top, name))

    def sweep_one(store):
        try:
            st = os.lstat(store)
        except OSError:
            return
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return
        fd = None
        # (killed while hold_store made its lock: lock.new)
        for lock in ("lock", "lock.new"):
            try:
                fd = os.open(os.path.join(store, lock), os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
                break
            except OSError:
                continue
        try:
            if (fd is None or lock == "lock.new") and time.time() - st.st_mtime < STORE_MAKING_S:
                return                                 # being made (lock.new is locked next)
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(store, ignore_errors=True)
            log("info", "removed a checkpoint store left by a server that was killed",
                store=store)
        except OSError:
            pass                                       # a live server's
        finally:
            if fd is not None:
                os.close(fd)
    thread = threading.Thread(target=sweep, daemon=True, name="boris-sweep")
    thread.start()
    return thread


# Where the store keeps one blob: the number of its pack file, its offset and size there
StoredBlob = namedtuple("StoredBlob", "pack offset size")


class Store:
    """The server's one content-addressed store of file bytes, shared by the checkpoints of
    every session and by undo_edit: a private 0700 directory made at first use where
    store_place says, with a lock that tells sweep_stores it is a live server's. Bytes are
    appended to pack files of up to STORE_PACK_BYTES, found again through an index in
    memory (the store lives as long as its server), so that a store of a whole tree is a
    few files: close() removes it at once, where a file a blob took seconds."""

    def __init__(self, config, roots):
        self.config, self.roots = config, list(roots)
        self.lock = threading.Lock()              # guards every field below
        # digest -> StoredBlob; the bytes held
        self.index, self.stored = {}, 0
        # the pack written to (a descriptor), how many, its size
        self.pack, self.packs, self.packed = None, 0, 0
        self.dir = self.lockfd = None
        # bytes it may hold; 0: no store (off, or none could be made)
        self.budget = None
        self.why = "--checkpoint-budget off"      # why there is no store, once budget is 0

    def check(self):
        """At start-up: turn checkpoints off, and say so once, where no store can be made."""
        if self.config.checkpoint_budget != 0 and store_place(self.roots) is None:
            self.budget, self.why = 0, NO_STORE
            log("warn", "checkpoints are off: " + NO_STORE)

    def open(self):
        """Make the store (once): False when checkpoints are off or it cannot be made."""
        import shutil
        import tempfile
        with self.lock:
            if self.dir is not None:
                return True
            budget = self.config.checkpoint_budget
            if budget == 0 or self.budget == 0:
                return False
            base = store_place(self.roots)
            try:
                if base is None:
                    raise OSError(errno.EACCES, NO_STORE)
                where = tempfile.mkdtemp(prefix=CHECKPOINT_PREFIX, dir=base)
                try:
                    self.lockfd = hold_store(where)
                except OSError:
                    shutil.rmtree(where, ignore_errors=True)
                    raise
            except OSError as e:
                self.budget, self.why = 0, "their store could not be made (%s)" % (e.strerror or e)
                log("warn", "checkpoints are off: " + self.why)
                return False
            if budget is None:
                free = os.statvfs(where)
                budget = min(CHECKPOINT_BUDGET_AUTO, free.f_bavail * free.f_frsize // 4)
            self.dir, self.budget = where, budget
            return True

    def put(self, data):
        """(digest of `data`, kept in the store; or None and why not). Any thread may put: a
        scan, or an edit keeping the bytes undo_edit restores (keep_for_undo)."""
        import hashlib
        digest = hashlib.blake2b(data, digest_size=20).hexdigest()
        with self.lock:
            if digest in self.index:
                return digest, None
            if self.dir is None or self.stored + len(data) > self.budget:
                return None, "past --checkpoint-budget"
            try:
                if self.pack is None or self.packed + len(data) > STORE_PACK_BYTES:
                    self.shut_pack()
                    self.pack = os.open(os.path.join(self.dir, "pack%d" % (self.packs + 1)),
                                        os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o600)
                    self.packs, self.packed = self.packs + 1, 0
                # (no fsync: the store lives as long as the server)
                write_all(self.pack, data)
            except OSError as e:
                self.shut_pack()                  # (a pack written in part is not written to again)
                return None, "not stored (%s)" % (e.strerror or e)
            self.index[digest] = StoredBlob(self.packs, self.packed, len(data))
            self.packed += len(data)
            self.stored += len(data)
        return digest, None

    def shut_pack(self):
        """Close the pack written to, if one is open (lock held)."""
        if self.pack is not None:
            os.close(self.pack)
            self.pack = None

    def blob(self, digest):
        """The bytes kept under `digest` (OSError once the store is gone, or for one it never
        held)."""
        with self.lock:
            where, at = self.dir, self.index.get(digest)
        if where is None or at is None:
            raise OSError(errno.ENOENT, "the checkpoint store was removed with its server"
                          if where is None else "the checkpoint store holds no bytes %s" % digest)
        fd = os.open(os.path.join(where, "pack%d" % at.pack), os.O_RDONLY | O_CLOEXEC)
        try:
            data = os.pread(fd, at.size, at.offset)
        finally:
            os.close(fd)
        if len(data) != at.size:
            raise OSError(errno.EIO, "the checkpoint store lost bytes of %s" % digest)
        return data

    def close(self):
        """Remove the store (nothing more is kept)."""
        import shutil
        with self.lock:
            where, lockfd, self.dir, self.lockfd, self.budget = self.dir, self.lockfd, None, None, 0
            self.shut_pack()
        if where is not None:
            shutil.rmtree(where, ignore_errors=True)
        if lockfd is not None:
            os.close(lockfd)


# -- git's index ------------------------------------------------------------------
GIT_FILTERING = re.compile(rb"(^|\s)-?(text|eol|crlf|filter|ident|working-tree-encoding)\b")


class GitIndex:
    """What a git work tree's index says of its clean files. A file whose lstat agrees with its
    entry (git's own test: ctime, mtime, inode and size, each as the index keeps it) holds the
    blob the entry names, unless the entry is racy (changed as late as the index was written);
    a checkpoint then records "g" + the blob's id instead of copying the bytes, and a rewind
    reads them back with `git cat-file`. Once a whole walk has recorded what the index says,
    its entries are let go (a walk after it reads only files whose stat changed, which an
    index that did not change cannot vouch for), and read again when the index changes.
    Used only where the bytes in the work tree are the
    blob's to the byte: no line-ending conversion, filters or encodings (core.autocrlf, the
    attributes text, eol, filter, ident, working-tree-encoding), index versions 2 to 4 with
    SHA-1, no split index, and git installed."""

    def __init__(self, top, gitdir, git):
        self.top, self.gitdir, self.git = top, gitdir, git
        self.stamp = None                         # (mtime_ns, size, inode) of the index file read
        # directory under top -> its files: name, NUL, stat key (24 bytes) and blob id (20 bytes),
        # one after another
        self.dirs = {}

    @classmethod
    def of(cls, root):
        """The GitIndex of the work tree holding `root` (found by walking up to its .git), or None:
        not in a work tree, or no git to read objects back with."""
        import shutil
        git = shutil.which("git")
        top = root
        while git:
            dotgit = os.path.join(top, ".git")
            if os.path.isdir(dotgit):
                return cls(top, dotgit, git)
            # a worktree's or submodule's: "gitdir: <path>"
            if os.path.isfile(dotgit):
                try:
                    line = read_plain(dotgit, 4096).decode("utf-8", "surrogateescape").strip()
                except OSError:
                    return None
                if not line.startswith("gitdir: "):
                    return None
                return cls(top, os.path.normpath(os.path.join(top, line[8:])), git)
            if top == "/":
                return None
            top = os.path.dirname(top)
        return None

    def refresh(self, pause):
        """Read the index again when it changed (or forget it when it cannot be trusted);
        pause() is called every 4,096 entries (a background walk gives way there)."""
        try:
            st = os.stat(os.path.join(self.gitdir, "index"))
        except OSError:
            self.stamp, self.dirs = None, {}
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self.stamp:
            return
        self.stamp, self.dirs = stamp, {}
        try:
            data = read_plain(os.path.join(self.gitdir, "index"))
            dirs = self.parse(data, divmod(st.st_mtime_ns, 10 ** 9), pause)
            del data
            if self.converts(dirs):
                return
            self.dirs = dirs
        except (OSError, ValueError, IndexError, struct.error) as e:
            log("info", "checkpoints copy this work tree's files: its index is not one they read",
                top=self.top, error=str(e))

    @staticmethod
    def parse(data, written, pause):
        """{directory: its files, as self.dirs keeps them} of an index's stage-0 regular files
        that are not racy (changed before `written`, the index's own mtime as (seconds,
        nanoseconds))."""
        magic, version, count = struct.unpack_from(">4sII", data)
        if magic != b"DIRC" or version not in (2, 3, 4):
            raise ValueError("not an index of version 2, 3 or 4")
        entries, pos, name = defaultdict(bytearray), 12, b""
        unpack = struct.Struct(">10I20sH").unpack_from
        for k in range(count):
            if not k % 4096:
                pause()
            cs, cn, ms, mn, _, ino, mode, _, _, size, sha, flags = unpack(data, pos)
            at, skip = pos + 62, 0
            if flags & 0x4000 and version >= 3:
                # extended flags: skip-worktree, intent-to-add
                skip = struct.unpack_from(">H", data, at)[0] & 0x6000
                at += 2
            # the name: how much of the last to drop, then more
            if version == 4:
                c = data[at]
                at, strip = at + 1, c & 127
                while c & 128:
                    c = data[at]
                    at, strip = at + 1, ((strip + 1) << 7) | (c & 127)
                end = data.index(b"\0", at)
                name = name[:len(name) - strip] + data[at:end]
                pos = end + 1
            else:
                # the name, padded with NULs to a multiple of 8
                end = data.index(b"\0", at)
                name = data[at:end]
                pos += (at - pos + len(name) + 8) & ~7
            if skip or flags & 0x3000 or mode >> 12 != 0o10 or (ms, mn) >= written:
                continue
            cut = name.rfind(b"/")
            stat_key = struct.pack(">6I", cs, cn, ms, mn, ino, size)
            entries[name[:max(cut, 0)]] += name[cut + 1:] + b"\0" + stat_key + sha
        if data[pos:pos + 4] == b"link":
            raise ValueError("a split index")
        return {os.fsdecode(d): bytes(files) for d, files in entries.items()}

    def converts(self, entries):
        """Whether git changes bytes between this work tree and its blobs (then nothing is
        taken from the index): core.autocrlf, or an attribute that converts in a tracked
        .gitattributes, the repository's info/attributes or the user's attributes file."""
        try:
            code, out, _ = run_program(
                [self.git, "--git-dir", self.gitdir, "config", "--get-regexp",
                 r"^(core\.autocrlf|core\.attributesfile|extensions\.objectformat|filter\..*)$"],
                "/", 10)
        except OSError:
            return True
        if code not in (0, 1):                        # 1: none of them set
            return True
        out = out.decode("utf-8", "replace")
        settings = dict(line.partition(" ")[::2] for line in out.lower().splitlines())
        if (settings.get("core.autocrlf", "false") != "false"
                or settings.get("extensions.objectformat", "sha1") != "sha1"):
            return True
        files = [os.path.join(self.top, d, ".gitattributes") for d, packed in entries.items()
                 # (a name that ends so too: no such file, no harm)
                 if b".gitattributes\0" in packed]
        files += [os.path.join(self.gitdir, "info", "attributes"), os.path.expanduser(
            settings.get("core.attributesfile")
            or os.path.join(os.environ.get("XDG_CONFIG_HOME") or "~/.config", "git", "attributes"))]
        for path in files:
            try:
                text = read_plain(path, 1 << 20)
            except OSError:
                continue                                      # none there: nothing converts
            if any(GIT_FILTERING.search(line.split(None, 1)[1]) for line in text.splitlines()
                   if len(line.split(None, 1)) == 2 and not line.startswith(b"#")):
                return True
        return False

    def children(self, path):
        """{name: stat key + blob id} of the files the index lists in directory `path`."""
        packed = self.dirs.get(path[len(child_prefix(self.top)):] if path != self.top else "")
        out, at = {}, 0
        while packed and at < len(packed):
            end = packed.index(b"\0", at)
            out[os.fsdecode(packed[at:end])] = packed[end + 1:end + 45]
            at = end + 45
        return out

    @staticmethod
    def blob_of(known, name, st):
        """"g" + the id of the blob file `name` holds, when its lstat `st` agrees with its entry
        in `known` (children()); else None."""
        entry = known.get(name)
        if entry is None:
            return None
        m = 0xFFFFFFFF
        key = struct.pack(">6I", st.st_ctime_ns // 10 ** 9 & m, st.st_ctime_ns % 10 ** 9,
                          st.st_mtime_ns // 10 ** 9 & m, st.st_mtime_ns % 10 ** 9, st.st_ino & m,
                          st.st_size & m)
        return "g" + entry[24:].hex() if entry[:24] == key else None


class CatFile:
    """`git cat-file --batch` of one repository, for the blobs a rewind writes back."""

    def __init__(self, index):
        import subprocess
        self.proc = spawn([index.git, "--git-dir", index.gitdir, "cat-file", "--batch"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def read(self, sha):
        """The blob `sha`'s bytes; OSError when the repository no longer has it."""
        self.proc.stdin.write(sha.encode("ascii") + b"\n")
        self.proc.stdin.flush()
        head = self.proc.stdout.readline().split()
        if len(head) != 3 or head[1] != b"blob":
            raise OSError(errno.ENOENT, "its blob %s is gone from the git repository (a git gc"
                          " after history was rewritten?)" % sha)
        return self.proc.stdout.read(int(head[2]) + 1)[:-1]        # (the blob, then a newline)

    def close(self):
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass  # git ended first: nothing lost
        self.proc.wait()
        reaped(self.proc)


# a directory's child: kind, mode, size, mtime_ns, ctime_ns, inode, payload
CHILD = struct.Struct("<cIqqqQH")
Entry = namedtuple("Entry", "kind mode data size mtime ctime ino")
Entry.__doc__ = """A path in a checkpoint: kind 'f' (data: its digest, None when it is not
covered), 'l' (data: the link's target) or 'd' (data: None), its mode, then the stat key that
tells a change: size, mtime and ctime in ns, inode. The first three are what a rewind puts back."""


# -- what a checkpoint keeps ------------------------------------------------------
def pack_children(children):
    """One directory's children [(name, entry)] as the bytes a Checkpoint keeps (about 60 bytes
    a child, where a dict of tuples took 700): the names joined by NULs first (so that a walk
    can tell the same listing at a glance), then per child its fixed fields and a payload: a
    link's target, or a file's digest ('s' + the store's 20 bytes, 'g' + a git blob id's)."""
    names, records = [], []
    for name, (kind, mode, digest, size, mtime, ctime, ino) in children:
        names.append(os.fsencode(name))
        payload = b"" if digest is None else os.fsencode(digest) if kind == "l" else \
            b"g" + bytes.fromhex(digest[1:]) if digest[0] == "g" else b"s" + bytes.fromhex(digest)
        records.append(CHILD.pack(kind.encode(), mode, size, mtime, ctime, ino, len(payload))
                       + payload)
    joined = b"\0".join(names)
    return struct.pack("<I", len(joined)) + joined + b"".join(records)


def child_names(packed):
    """The names block of pack_children's bytes (compared as it is)."""
    return packed[4:4 + struct.unpack_from("<I", packed)[0]]


def unpack_children(packed):
    """pack_children's bytes back as {name: Entry}."""
    names = child_names(packed).split(b"\0") if len(packed) > 4 else []
    at, out = 4 + struct.unpack_from("<I", packed)[0], {}
    for name in names:
        kind, mode, size, mtime, ctime, ino, length = CHILD.unpack_from(packed, at)
        at += CHILD.size
        payload, kind = packed[at:at + length], kind.decode()
        at += length
        digest = None if not payload else os.fsdecode(payload) if kind == "l" else \
            "g" + payload[1:].hex() if payload[:1] == b"g" else payload[1:].hex()
        out[os.fsdecode(name)] = Entry(kind, mode, digest, size, mtime, ctime, ino)
    return out


def below_any(dirs, tops):
    """{directory: packed children} of those in `dirs` at or below one of the directories `tops`."""
    out = {}
    for d, packed in dirs.items() if tops else ():
        up = d
        while up not in tops and up != "/":
            up = up[:up.rfind("/")] or "/"
        if up in tops:
            out[d] = packed
    return out


def rewind_plan(old, cur, within, partial):
    """(paths to remove, paths to make) for a rewind from entries `cur` to entries `old`
    (flat maps), under the paths `within` (all when empty; the directories above those come
    back too); nothing is removed that the old state did not cover when it is `partial`."""
    above = {p for p, e in old.items() if e.kind == "d" and any(is_within(w, p) for w in within)}

    def wanted(p):
        return not within or p in above or any(is_within(p, w) for w in within)
    drop = [p for p, e in cur.items() if wanted(p) and (
        p not in old and not partial or p in old and old[p].kind != e.kind)]
    put = [p for p, e in old.items() if wanted(p) and (p not in cur or cur[p][:3] != e[:3])]
    return drop, put


class Listing:
    """One directory's children as a checkpoint's walk meets them: a directory quiet since
    it was last looked at (`old`, its packed children then) keeps them unread when it lists
    the same names; the others' children are looked at one by one, by `look(path, old entry,
    git's index entries of the directory)` -> (entry or None, whether it can stay unread)."""

    def __init__(self, path, old, quiet, repo, look):
        self.path, self.old, self.repo, self.look = path, old, repo, look
        self.names, self.children, self.all_reusable = [], [], True
        self.unread = quiet and old is not None
        self.before = self.known = None
        if not self.unread:
            self.read()

    def read(self):
        """What to look at the children with: their old entries and git's index's."""
        self.before = unpack_children(self.old) if self.old is not None else {}
        self.known = self.repo.children(self.path) if self.repo is not None else {}

    def add(self, name):
        """The walk met child `name`."""
        if self.unread:
            self.names.append(name)
            return
        entry, reusable = self.look(child_prefix(self.path) + name, self.before.get(name),
                                   self.known)
        if entry is not None:
            self.children.append((name, entry))
            self.all_reusable &= reusable

    def packed(self):
        """(the children packed, or None when there are none; whether every one looked at can
        stay unread while the directory is quiet, or None when they were all kept unread)."""
        if self.unread:
            if child_names(self.old) == "\0".join(self.names).encode("utf-8", "surrogateescape"):
                return self.old, None
            # (another listing: each looked at after all)
            self.unread = False
            self.read()
            for name in self.names:
                self.add(name)
        if not self.children:
            return None, self.all_reusable
        packed = pack_children(self.children)
        return (self.old if packed == self.old else packed), self.all_reusable


# What a walk hands a waiter that waited CHECKPOINT_WAIT_S: the walk so far (the ask it answers)
WalkPart = namedtuple("WalkPart", "ask dirs size missed")
# The state a walk's skips are judged by: watch events taken, ignore stacks above the roots
WalkMark = namedtuple("WalkMark", "generation stacks")


class Checkpoint:
    """One state of the workspace: `dirs` {directory: its children, packed (pack_children)}
    (a file over --max-file-size or past the budget has digest None: not covered), how many
    entries (`size`), what was left out (`missed`: [(path, why)]), whether the walk stopped
    early (`partial`), its time and the calls that followed it. A directory unchanged from
    one checkpoint to the next keeps the same bytes object: memory goes with what changed."""

    def __init__(self, number, dirs, size, missed, partial):
        self.number, self.dirs, self.size = number, dirs, size
        self.missed, self.partial = missed, partial
        self.taken = time.time()
        self.followed = []                      # what was called after it, while it was the latest

    def flat(self):
        """{path: entry} of every entry (unpack_children), for a rewind or a diff."""
        return {child_prefix(d) + name: e for d, packed in self.dirs.items()
                    for name, e in unpack_children(packed).items()}


def entry_changes(old, new, partial=False):
    """(added, modified, deleted) paths between two Checkpoints, each sorted; none added when
    `partial` (what the old one did not walk is not known to be new)."""
    added, modified, deleted = [], [], []
    for d in set(old.dirs) | set(new.dirs):
        a, b = old.dirs.get(d), new.dirs.get(d)
        if a == b:
            continue
        a, b = unpack_children(a or b"\0" * 4), unpack_children(b or b"\0" * 4)
        prefix = child_prefix(d)
        added += [prefix + n for n in b if n not in a and not partial]
        deleted += [prefix + n for n in a if n not in b]
        modified += [prefix + n for n, e in b.items() if n in a and a[n][:3] != e[:3]]
    return sorted(added), sorted(modified), sorted(deleted)


# -- a session's checkpoints ------------------------------------------------------
NOT_CANCELLED = threading.Event()      # never set: the `cancelled` of a call nobody can cancel
CANCELLED_BEFORE = object()            # Checkpoints.before: the call was cancelled while it waited


class Checkpoints:
    """A session's checkpoints of its workspace roots, their bytes in the server's store (see
    above). before() and after() frame each call that can change files; current() checkpoints
    now; rewind() puts a checkpoint back.

    One condition, `cond`, guards all their state. A walk of the workspace has the turn at
    the store (one at a time): the scanning thread's, for the checkpoints after() asks for,
    or a caller's that holds the turn itself (held(): checkpoints, rewind). A changing call
    waits in before() for the checkpoint asked for before it, counted in `waiters` (a walk
    that gave way to other calls goes on at once), no longer than its call is not cancelled,
    and at most CHECKPOINT_WAIT_S: then the walk hands it what it walked so far, which is
    kept as a partial checkpoint, and goes on in the background (its whole result is then
    the base the next walk compares with, not a checkpoint of its own: the call changed the
    workspace meanwhile). No lock is held while a walk gives way."""

    def __init__(self, roots, policy, config, busy=None, store=None):
        self.roots, self.policy, self.config = list(roots), policy, config
        self.busy = busy or (lambda: False)       # whether the session has calls in flight
        # (made here, it is closed here: a store of its own)
        self.own_store = store is None
        self.store = Store(config, self.roots) if store is None else store
        self.walk_policy = PathPolicy(policy.allow, policy.deny_raw + list(CHECKPOINT_SKIPPED),
                                      policy.workdir, policy.folds)
        self.cond = threading.Condition()         # guards every field below
        self.turn = False                         # a walk (or a rewind) has the store now
        self.waiters = 0                          # callers waiting for the turn or a checkpoint
        # checkpoints asked for (after, the first), and walks done for them
        self.asked = self.answered = 0
        self.scanner = False                      # the scanning thread runs
        # a waiter for this ask waited CHECKPOINT_WAIT_S: hand it a part
        self.want_part = 0
        self.part = None                          # that part (a WalkPart), handed over
        self.handed = False                       # the walk in progress handed a part over
        # the ask the walk in progress answers, and when it began
        self.walk_for, self.walk_began = 0, 0.0
        # the last whole walk: what the next compares with
        self.base = Checkpoint(0, {}, 0, [], False)
        self.list = []                            # Checkpoint, oldest first
        self.count = 0
        # the ignore files, compiled once; directories watched
        self.cache = WalkCache(watch=True)
        # the GitIndex of each git work tree holding a root
        self.repos = []
        for root in self.roots:
            repo = GitIndex.of(root)
            if repo is not None and all(r.top != repo.top for r in self.repos):
                self.repos.append(repo)
        # the WalkMark when the last scan found all it walked watched and unchanged: the same
        # mark again means nothing changed since
        self.whole_mark = None
        self.linked = set()                       # (dev, inode) of files seen with other hard links
        # the ignore stacks above the roots when the last walk watched every directory it entered:
        # the next may leave quiet ones out
        self.prune_stacks = None
        self.nested = set()                       # directories met holding a .git of their own
        self.closed = False
        self.stopped = threading.Event()          # set by close()

    def open_store(self):
        """Whether checkpoints can be taken: not closed, and the server's store is there
        (made now, at first use)."""
        return not self.closed and self.store.open()

    def start(self):
        """Take the first checkpoint in the background, CHECKPOINT_FIRST_S after the session
        began."""
        def first():
            if not self.stopped.wait(CHECKPOINT_FIRST_S) and not self.list:
                self.after()
        threading.Thread(target=first, daemon=True, name="boris-checkpoint-first").start()

    def ask(self):
        """Ask the scanning thread (started when not running) for a checkpoint of the state as
        it is now; the number its walk answers. The caller holds cond."""
        self.cond.notify_all()      # first: RuntimeError, nothing changed, where it is not held
        self.asked += 1
        if not self.scanner and not self.closed:
            self.scanner = True
            try:
                threading.Thread(target=self.run, daemon=True, name="boris-checkpoint").start()
            except Exception:
                # no thread to be had: nobody waits for a walk that cannot run
                self.scanner = False
                self.answered = self.asked
                log("error", "no thread for a checkpoint", error=_traceback())
        return self.asked

    def run(self):
        """The scanning thread: while a checkpoint is asked for, take the turn and walk."""
        while True:
            with self.cond:
                while not self.closed and self.asked > self.answered and self.turn:
                    self.cond.wait()
                if self.closed or self.asked <= self.answered:
                    self.scanner = False
                    self.cond.notify_all()
                    return
                self.turn, this = True, self.asked
                self.walk_for, self.walk_began = this, time.monotonic()
            try:
                self.scan(background=True)
            except Exception:
                log("error", "a checkpoint failed", error=_traceback())
            finally:
                with self.cond:
                    self.turn, self.answered = False, max(self.answered, this)
                    self.cond.notify_all()

    def before(self, call, cancelled=NOT_CANCELLED):
        """A call that can change files is about to run: wait for the checkpoint asked for
        before it (the first one, or the one the last call's end asked for): at most
        CHECKPOINT_WAIT_S, then with what its walk has so far (a partial checkpoint), and
        note the call on the latest checkpoint. None, or a line for the call's answer when
        the checkpoint before it is partial; CANCELLED_BEFORE when the call was cancelled first."""
        if not self.open_store():
            return None
        deadline, missing = time.monotonic() + CHECKPOINT_WAIT_S, None
        with self.cond:
            target = self.ask() if not self.list and not self.asked else self.asked
            self.waiters += 1
            self.cond.notify_all()                # a walk giving way goes on
            try:
                while not self.closed:
                    if self.record_part(target) or self.answered >= target:
                        break
                    if cancelled.is_set():
                        return CANCELLED_BEFORE
                    now = time.monotonic()
                    if now >= deadline and self.turn and self.walk_for >= target:
                        # it hands its part soon (should_stop)
                        self.want_part = max(self.want_part, target)
                    elif self.waited_in_vain(target, now, deadline):
                        missing = ("No checkpoint was taken before this call: a walk of the"
                                   " workspace that began before the last call ended takes longer"
                                   " than %g s (a first one, on a large tree); the checkpoints"
                                   " after it cover this call's changes" % CHECKPOINT_WAIT_S)
                        break
                    self.cond.wait(CHECKPOINT_YIELD_S)
                partial = False
                for latest in self.list[-1:]:              # (the latest, when there is one)
                    latest.followed = (latest.followed
                                       + [call + (" (not covered)" if missing else "")])[-5:]
                    partial = latest.partial
            finally:
                self.waiters -= 1
                self.cond.notify_all()
        if missing:
            return "(%s.)" % missing
        if partial:
            return ("(The checkpoint before this call covers part of the workspace: %s; checkpoints"
                    " lists what it covers.)" % partial)
        return None

    def record_part(self, target):
        """Keep what a walk handed over, when it answers the ask `target`, as a partial
        checkpoint (the caller holds cond): whether it did."""
        part = self.part
        if part is None or part.ask < target:
            return False
        self.part = None
        self.record(Checkpoint(self.count + 1, part.dirs, part.size, part.missed,
                               "the rest was not walked within %g s (the next checkpoint"
                               " covers it)" % CHECKPOINT_WAIT_S))
        return True

    def waited_in_vain(self, target, now, deadline):
        """Whether a caller waiting for the walk that answers the ask `target` stops without
        a checkpoint (it holds cond, and no part is coming): at its deadline while another
        walk, or a rewind, has the turn; well past it in any case; or once a walk not for it
        has run CHECKPOINT_WAIT_S."""
        return (now >= deadline and self.turn
                or now >= deadline + 2 * CHECKPOINT_PART_MIN_S
                or (self.turn and self.walk_for < target
                    and now - self.walk_began >= CHECKPOINT_WAIT_S))

    def after(self):
        """A call that can change files ended: checkpoint in the background."""
        if not self.open_store():
            return
        with self.cond:
            if not self.closed:
                self.ask()

    def give_way(self):
        """A background walk pauses while the session has calls in flight that do not wait for
        it, or had one CHECKPOINT_CALM_S ago (a search or a burst of views runs at full speed),
        and goes on at once when one begins to wait, or once the session is calm (looked at
        every CHECKPOINT_YIELD_S)."""
        while self.busy():
            with self.cond:
                if self.waiters or self.closed:
                    return
                self.cond.wait(CHECKPOINT_YIELD_S)

    @contextlib.contextmanager
    def held(self, cancelled=NOT_CANCELLED):
        """The turn at the store for a block, once the walk in progress ends (a walk waited
        for does not give way); ToolError when the checkpoints closed or `cancelled` was set
        first."""
        with self.cond:
            self.waiters += 1
            self.cond.notify_all()
            try:
                while self.turn and not self.closed and not cancelled.is_set():
                    self.cond.wait(CHECKPOINT_YIELD_S)
                if self.closed or cancelled.is_set():
                    raise ToolError(INVALID_INPUT, "cancelled, or the session ended, while a"
                                    " checkpoint was being taken")
                self.turn = True
            finally:
                self.waiters -= 1
                self.cond.notify_all()
        try:
            yield self
        finally:
            with self.cond:
                self.turn = False
                self.cond.notify_all()

    def current(self, cancelled=NOT_CANCELLED):
        """Checkpoint now, for a caller that holds the turn (a rewind keeps it, so that no walk
        comes between the state it reads and what it writes): the latest Checkpoint, whole;
        None when off, closed or cancelled."""
        if not self.open_store():
            return None
        with self.cond:
            self.walk_for, self.walk_began = self.asked, time.monotonic()
        self.scan(cancelled=cancelled)
        with self.cond:
            return self.list[-1] if self.list and not cancelled.is_set() else None

    def scan(self, background=False, cancelled=NOT_CANCELLED):
        """Walk the roots (the caller holds the turn) and keep the state as a new checkpoint,
        unless it is the latest's, or a part of the walk was handed to a waiter (then it is
        only the base of the next walk); a background walk gives way to the session's other
        calls. A file newly seen with other hard links may be one whose changes through that
        link raise no event: then no directory is quiet any more and the walk is made again."""
        assert self.turn
        with self.cond:
            self.handed = False
        linked, w = len(self.linked), self.cache.watches
        checkpoint = self.walk(background, cancelled)
        if checkpoint is not None and len(self.linked) > linked and w is not None and w.quiet:
            w.quiet.clear()
            self.whole_mark = None
            checkpoint = self.walk(background, cancelled)
        if checkpoint is not None and checkpoint.size >= CHECKPOINT_TRIM_ENTRIES:
            # (a big walk leaves pages the server no longer uses)
            trim_memory()
        with self.cond:
            # handed over, but the walk ended first: none partial
            if self.part is not None:
                self.part, self.handed = None, False
            if checkpoint is not None:
                self.base = checkpoint
                if not (self.handed and background):
                    self.record(checkpoint)
            elif self.list and self.list[-1].partial and self.whole_mark is not None \
                    and not self.stopped.is_set() and not cancelled.is_set():
                # no event since (no walk ran to hand a part): the base is whole
                checkpoint = Checkpoint(self.count + 1, self.base.dirs, self.base.size, [], False)
                self.record(checkpoint)
            # (whole, or known unchanged): answered
            if checkpoint is not None or self.whole_mark is not None:
                self.answered = max(self.answered, self.walk_for)
            if self.want_part <= self.walk_for:
                self.want_part = 0

    def record(self, checkpoint):
        """Keep `checkpoint` as the newest checkpoint (the caller holds cond): as the latest, with
        fresher stats, when it holds the same state; the oldest go past the bounds."""
        self.cond.notify_all()      # RuntimeError, nothing changed, where cond is not held
        if self.list and not self.list[-1].partial \
                and not any(entry_changes(checkpoint, self.list[-1])):
            # the same state (kinds, modes, bytes, link targets): fresher stats, same checkpoint
            self.list[-1].dirs = checkpoint.dirs
            return
        self.count += 1
        checkpoint.number = self.count
        self.list.append(checkpoint)
        held = sum(c.size for c in self.list)
        while len(self.list) > CHECKPOINTS_KEPT or held > CHECKPOINT_ENTRIES and len(self.list) > 1:
            held -= self.list.pop(0).size

    def should_stop(self, background, cancelled, so_far, size, missed):
        """Whether a walk stops here (closed or cancelled: nothing kept). First, a background
        walk gives way, and a waiter it answers that waited long enough is handed what was
        walked, once the walk has run CHECKPOINT_PART_MIN_S."""
        if background:
            self.give_way()
        with self.cond:
            if 0 < self.want_part <= self.walk_for and self.part is None and not self.handed \
                    and size and time.monotonic() - self.walk_began >= CHECKPOINT_PART_MIN_S:
                self.part = WalkPart(self.walk_for, so_far(), size, list(missed))
                self.handed = True
                self.want_part = 0
                self.cond.notify_all()
        return self.stopped.is_set() or cancelled.is_set()

    def walk(self, background, cancelled=NOT_CANCELLED):
        """scan()'s walk: the state as a Checkpoint numbered next; None when closed, stopped
        or known unchanged. A directory quiet since it was last looked at (watched, and no
        event about it or its entries) that lists the same names keeps its packed children
        unread; the others' children are looked at one by one (entry()). When every directory
        is watched and the ignore files above the roots are the same, a quiet directory with
        nothing below it that is not quiet is not entered at all: the last walk's entries of
        it and all below it stand (a .gitignore changed anywhere makes no directory quiet).
        Below a .git of its own, whose exclude file raises no event here, each is entered."""
        if self.closed:
            return None                                      # closed meanwhile
        self.cache.refresh()
        w = self.cache.watches
        mark = None if w is None else WalkMark(w.generation,
                                               [self.cache.outer(root) for root in self.roots])
        last = self.whole_mark
        if self.list and last is not None and mark.generation == last.generation and all(
                map(same_objects, mark.stacks, last.stacks)):
            # no event since a scan that watched all of it
            return None
        for repo in self.repos:
            repo.refresh(self.give_way if background else (lambda: None))
        prune = self.prune_stacks is not None and not self.base.partial and all(
            map(same_objects, mark.stacks, self.prune_stacks))
        checkpoint, visited, looked, unwatched = self.walk_roots(background, cancelled, prune)
        if checkpoint is None:
            return None                                      # closed or cancelled: nothing to keep
        if w is not None:
            # (quiet from now on: this walk is the base)
            w.quiet.update(looked)
        # what lets the next walk skip (quiet directories, or all): a whole walk, watched
        self.prune_stacks = self.whole_mark = None
        if not checkpoint.partial:
            for repo in self.repos:
                # recorded now: the next walk reads the index again only once it changed
                repo.dirs = {}
            if w is not None:
                if all(map(w.of.__contains__, visited)):
                    self.prune_stacks = mark.stacks
                if not unwatched and all(map(w.clean.__contains__, visited)):
                    self.whole_mark = mark
        return checkpoint

    def walk_roots(self, background, cancelled, prune):
        """walk()'s walk of the roots, leaving quiet directories out when `prune` (see walk()):
        (a Checkpoint numbered next, or None when stopped; the directories walked; those
        looked at whole while watched; those looked at otherwise)."""
        visited, looked, unwatched = [], set(), []
        w = self.cache.watches
        quiet, watched = (w.quiet, w.of) if w is not None else (set(), {})
        prev, dirs, missed, partial, size = self.base.dirs, {}, [], False, 0
        left_out, pruned = self.pruner(quiet) if prune else (None, set())
        # the store's directory where it lies in a root (the walk leaves it out)
        store = self.store.dir
        store = store if store and any(is_within(store, r) for r in self.roots) else None
        look = lambda path, old, known: self.entry(path, old, missed, known)
        # the Listing of the directory the walk is in
        here = None

        def settle():
            if here is None:
                return                                       # (no directory met yet)
            packed, reusable = here.packed()
            if packed is not None:
                dirs[here.path] = packed
            if reusable is not None:                         # (None: kept unread, still quiet)
                quiet.discard(here.path)
                # (its watch was set before the lstats)
                if reusable and here.path in watched:
                    looked.add(here.path)
                else:
                    unwatched.append(here.path)

        def so_far():
            """What was walked so far, the directory in progress included (a part handed over)."""
            part = dict(dirs)
            if here is not None and here.children:
                part[here.path] = pack_children(here.children)
            return part
        for root in self.roots:
            if partial:
                break
            repo = self.repo_of(root)
            walker = self.walker(root, left_out, visited)
            here = None
            # (a directory's children come together)
            for path, _, _, _ in walker:
                if size >= CHECKPOINT_WALK_MAX:
                    partial = ("the walk stopped at %d entries (narrow --allow-dir)"
                               % CHECKPOINT_WALK_MAX)
                    break
                if not size % 256 and self.should_stop(background, cancelled, so_far, size,
                                                        missed):
                    return None, visited, looked, unwatched   # closed or cancelled: nothing to keep
                if store is not None and is_within(path, store):
                    # the store itself (where it lies in a root)
                    continue
                cut = path.rfind("/")
                d = path[:cut or 1]
                if here is None or d != here.path:
                    settle()
                    here = Listing(d, prev.get(d), d in quiet, repo, look)
                here.add(path[cut + 1:])
                size += 1
            settle()
        kept = below_any(prev, pruned)                       # what the directories left out held
        dirs.update(kept)
        size += sum(child_names(packed).count(b"\0") + 1 for packed in kept.values())
        return Checkpoint(self.count + 1, dirs, size, missed, partial), visited, looked, unwatched

    def walker(self, root, left_out, visited):
        """walk_roots()'s Walker of `root`: directories and symlinks found as themselves,
        watched from the first walk, its visits not kept in the cache; the directories it
        visits added to `visited`, those `left_out` says (if given) found but not entered,
        the repositories it meets below the root added to self.nested."""
        walker = Walker(root, self.walk_policy, False, self.cache)
        walker.want_dirs, walker.raw_links, walker.visited = True, True, visited
        walker.watch_first, walker.remember = True, False
        walker.prune, walker.repos = left_out or walker.prune, self.nested
        return walker

    def pruner(self, quiet):
        """walk_roots()'s test of a directory it may leave out (quiet, nothing below it that
        is not, and no nested repository at, above or below it), and the set of those it
        left out."""
        # the directories with one not quiet, or a .git, at or below them
        must_enter, pruned = set(), set()
        for d in [d for d in self.cache.watches.of if d not in quiet] + list(self.nested):
            while d not in must_enter:
                must_enter.add(d)
                d = d[:d.rfind("/")] or "/"

        def left_out(real):
            if real in must_enter or real not in quiet \
                    or any(is_within(real, n) for n in self.nested):
                return False
            pruned.add(real)
            return True
        return left_out, pruned

    def entry(self, path, old, missed, known):
        """(the entry of one path walked, whether it can stay unread while its directory is
        quiet): the old one when its lstat is unchanged, else made (a changed file read and
        its bytes stored, unless git's index `known` names its blob); None when it is gone.
        A file with other hard links (changed through one elsewhere, it raises no event
        here), changed within a clock tick or not stored is read again."""
        try:
            st = os.lstat(path)
        except OSError:
            return None, False                               # gone since listed
        key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            return Entry("d", mode, None, *key), True
        if stat.S_ISLNK(st.st_mode):
            try:
                # (a link is read again: it is cheap)
                return Entry("l", mode, os.readlink(path), *key), True
            except OSError:
                return None, False
        if not stat.S_ISREG(st.st_mode):
            return None, False
        reusable = st.st_nlink == 1
        if not reusable:
            # (scan(): a new one makes no directory quiet)
            self.linked.add((st.st_dev, st.st_ino))
        if old is not None and old.data is not None and old == Entry("f", mode, old.data, *key):
            return old, reusable
        digest, why = GitIndex.blob_of(known, path[path.rfind("/") + 1:], st), None
        if digest is None:
            digest, why = self.keep(path, st)
        if why:
            missed.append((path, why))
        if time.time() - st.st_ctime < LISTING_RACY_S:
            # changed within a clock tick: read again next time
            key = (st.st_size, -1, st.st_ctime_ns, st.st_ino)
            reusable = False
        return Entry("f", mode, digest, *key), reusable and digest is not None

    def keep(self, path, st):
        """(digest of the file's bytes, kept in the store; or None and why it is not covered)."""
        if st.st_size > self.config.max_file_size:
            return None, "over --max-file-size"
        try:
            fd = os.open(path, os.O_RDONLY | O_FILE)
            try:
                data = read_fd(fd, self.config.max_file_size, path)
            finally:
                os.close(fd)
        except (OSError, ToolError):
            return None, "unreadable"
        return self.put(data)

    def put(self, data):
        """(digest of `data`, kept in the store; or None and why not): what the server's store
        says, or why not when these checkpoints are closed."""
        return (None, "closed") if self.closed else self.store.put(data)

    def blob(self, digest):
        """The bytes the store keeps under `digest` (OSError once these checkpoints are closed
        or the store is gone)."""
        if self.closed:
            raise OSError(errno.ENOENT, "the checkpoints were closed with their session")
        return self.store.blob(digest)

    def find(self, number):
        """The checkpoint numbered `number`, or ToolError naming those kept."""
        for checkpoint in self.list:
            if checkpoint.number == number:
                return checkpoint
        raise ToolError(INVALID_INPUT, "no checkpoint %s; this session keeps %s" % (number, (
            "%d to %d" % (self.list[0].number, self.list[-1].number)) if self.list else "none yet"))

    def close(self):
        """Stop checkpointing, once the scan or rewind that has the turn has seen the stop (a
        scan within 256 entries); a store of its own goes with it."""
        self.stopped.set()
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            while self.turn:
                self.cond.wait()
        # (its watches: an inotify instance each session)
        self.cache.close()
        if self.own_store:
            self.store.close()

    def rewind(self, target, now, within, files, dry=False):
        """Put the entries of Checkpoint `target` back where `now` (a Checkpoint of the current
        state) differs, for paths under `within` (all when empty): (what was done, what could
        not be) as lists of (path, word). Removals go deepest first, then directories, files
        and links are made shallowest first, each step relative to a directory opened
        without following links (open_dir), each file written whole and renamed into place;
        directory modes last, each file under its edit lock in `files` (FileGuards), as the
        edit tools write. A path the target did not cover is left as it is. dry: only say what
        it would do."""
        old, cur = target.flat(), now.flat()
        drop, put = rewind_plan(old, cur, within, target.partial)
        # GitIndex -> its CatFile, for the blobs written back
        readers = {}
        step = (lambda *_: "") if dry else self.step      # (a dry run changes nothing)
        try:
            done, failed = [], []
            for p in sorted(drop, key=lambda p: (-p.count("/"), p)):
                why = step(p, cur[p], None, files, readers)
                (failed if why else done).append((p, why or "removed"))
            for p in sorted(put, key=lambda p: (p.count("/"), p)):
                e = old[p]
                if e.kind == "f" and e.data is None:
                    failed.append((p, "not covered by checkpoint %d" % target.number))
                    continue
                why = step(p, cur.get(p) if p not in drop else None, e, files, readers)
                (failed if why else done).append(
                    (p, why or ("brought back" if p not in cur else "restored")))
            for p in sorted((p for p in put if old[p].kind == "d" and not dry),
                            key=lambda p: -p.count("/")):
                try:
                    dfd = open_dir(p, flags=os.O_RDONLY | os.O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
                    try:
                        os.fchmod(dfd, old[p].mode)
                    finally:
                        os.close(dfd)
                except OSError:
                    pass                                         # reported by its step if it failed
            return done, failed
        finally:
            for reader in readers.values():
                reader.close()

    def step(self, path, now, want, files, readers):
        """Make `path` what entry `want` says (None: remove it, `now` being what is there),
        under its edit lock; '' when done, else why not."""
        directory, base = os.path.split(path)
        try:
            self.policy.check(path, path)
            dfd = open_dir(directory)
        except (OSError, ToolError) as e:
            return "not reachable without a link or out of scope (%s)" % (
                getattr(e, "strerror", None) or getattr(e, "message", e))
        try:
            with files.lock(path):
                return self.put_back(dfd, base, now, want,
                                     lambda: self.bytes_of(path, want.data, readers))
        except OSError as e:
            if e.errno == errno.ENOTEMPTY:
                return "kept: it holds files no checkpoint covers (ignored ones, say)"
            return e.strerror or str(e)
        finally:
            os.close(dfd)

    def bytes_of(self, path, digest, readers):
        """The bytes an entry's digest stands for: from the store, or ("g" + a blob id) from
        the git repository holding `path` (through one CatFile a repository per rewind)."""
        if not digest.startswith("g"):
            return self.blob(digest)
        repo = self.repo_of(path)
        if repo is None:
            raise OSError(errno.ENOENT, "its git repository is gone")
        if repo not in readers:
            readers[repo] = CatFile(repo)
        return readers[repo].read(digest[1:])

    def repo_of(self, path):
        """The GitIndex of the repository holding `path`, or None."""
        return next((r for r in self.repos if is_within(path, r.top)), None)

    def put_back(self, dfd, base, now, want, data):
        """step()'s change, relative to directory `dfd`: '' when done, else why not (OSError
        when the system refused)."""
        if want is None:
            if now.kind == "d":
                os.rmdir(base, dir_fd=dfd)
            else:
                os.unlink(base, dir_fd=dfd)
        elif want.kind == "d":
            if now is None:
                os.mkdir(base, 0o700, dir_fd=dfd)
        elif now is not None and now.kind == "d":
            return "a directory is there now (it holds files no checkpoint covers)"
        elif want.kind == "l":
            tmp = temp_name(base)
            os.symlink(want.data, tmp, dir_fd=dfd)
            try:
                os.replace(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError:
                os.unlink(tmp, dir_fd=dfd)
                raise
        else:
            replace_file(dfd, base, data(), None, want.mode)
        return ""


###############################################################################
# Tools: building blocks ######################################################
###############################################################################


# every tool, in listing order: filled by @tool where each is defined
TOOLS = []
# the tool modes (--anthropic-compat) a tool is listed in
DEFAULT, COMPAT = ("default",), ("compat",)
BOTH = DEFAULT + COMPAT


class Tool:
    """A tool as registered: its listing (name, description, input schema, annotations),
    its handler, the modes it is listed in, the error codes its enum arguments answer
    with (`codes`), `argument_error`, which turns a refused argument into the tool's
    own answer (the workspace tools answer in fixed strings), its `lane` in the
    worker pool (shell commands and calls that wait run in the session's shell lane,
    so the quick tools never queue behind them) and `goes_with`: the tools whose
    disabling takes it along. `description` and `schema` may be functions of the
    Config; made() gives the listed tool. `changes`: it can change files (its destructive
    hint), so the session checkpoints the workspace before it. @tool's keywords set the
    FIELDS (a misspelt one is a TypeError at import); the rest keep the defaults below."""
    FIELDS = frozenset(("handler", "modes", "codes", "lane", "goes_with", "hint",
                        "argument_error"))
    # lane: "shell" (commands, waits), "quick", or a function of the arguments
    handler, modes, codes, lane, goes_with, hint = None, BOTH, {}, "quick", (), ""

    def __init__(self, name, description, schema, annotations, **fields):
        unknown = set(fields) - self.FIELDS
        if unknown:
            raise TypeError("tool %r: no field %s" % (name, ", ".join(sorted(unknown))))
        self.name, self.description = name, description
        self.schema, self.annotations = schema, annotations
        self.__dict__.update(fields)

    @property
    def changes(self):
        """Whether it can change files (checkpointed before it)."""
        return bool(self.annotations.get("destructiveHint"))

    @staticmethod
    def argument_error(e):
        """A refused argument's ToolError as this tool answers it (unchanged here)."""
        return e

    def made(self, config):
        """This tool as `config` lists it: description and schema worked out."""
        def worked_out(field):
            return field(config) if callable(field) else field
        return Tool(**dict(vars(self), description=worked_out(self.description),
                           schema=worked_out(self.schema)))

    def listing(self, config):
        """The tool as tools/list shows it, with Claude Code's hints in _meta: load it from the
        first turn (--always-load), words its tool search finds it by, and, where
        --max-result-chars is over what it keeps inline, that its answers stay within that
        (so none is spilled to a file)."""
        meta = {"anthropic/searchHint": self.hint}
        if config.max_result_chars > CLAUDE_INLINE_CHARS:
            meta["anthropic/maxResultSizeChars"] = config.max_result_chars
        if self.name in config.always_load:
            meta["anthropic/alwaysLoad"] = True
        return {"name": self.name, "description": self.description, "inputSchema": self.schema,
                "annotations": self.annotations, "_meta": meta}


def tool(name, description, schema, annotations, **fields):
    """Register the decorated handler as tool `name` (`fields`: Tool's)."""
    def register(handler):
        TOOLS.append(Tool(name, description, schema, annotations, handler=handler, **fields))
        return handler
    return register


def build_tools(config):
    """The tools this server registers, in listing order, after compat and disabling;
    a ConfigError for a --disable-tools name no tool has."""
    off = disabled_tools(config)
    mode = COMPAT[0] if config.anthropic_compat else DEFAULT[0]
    return {t.name: t.made(config) for t in TOOLS if mode in t.modes and t.name not in off}


def tool_names():
    """Every name a tool can be registered under, with or without --anthropic-compat,
    in listing order: the names --disable-tools accepts."""
    return list(dict.fromkeys(t.name for t in TOOLS))


def disabled_tools(config):
    """The registered names --disable-tools removes: those named, and each tool that
    goes with one of them (@tool's goes_with: the task tools with bash, the compat
    editor with any of the tools it stands for). A name no tool has, there or in
    --always-load, is a ConfigError."""
    valid = tool_names()
    for flag, names in (("--disable-tools", config.disable_tools),
                        ("--always-load", config.always_load)):
        unknown = [n for n in names if n not in valid and n != "none"]
        if unknown:
            raise ConfigError("unknown tool name(s) for %s: %s; valid names: %s"
                              % (flag, ", ".join(unknown), ", ".join(valid)))
    off = set(config.disable_tools)
    off.update(t.name for t in TOOLS if off.intersection(t.goes_with))
    return off


def prop(kind, description, **extra):
    """A JSON Schema property of type `kind`."""
    return dict({"type": kind, "description": description}, **extra)


def obj(properties, required=()):
    """A JSON Schema object that takes only the given properties."""
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


def notes(title, read_only=False, destructive=False, open_world=False, idempotent=False):
    """A tool's annotations (MCP tool hints)."""
    return {"title": title, "readOnlyHint": read_only, "destructiveHint": destructive,
            "idempotentHint": idempotent, "openWorldHint": open_world}


PATH_PROP = prop("string", "Path, absolute or relative to the working directory.")
RANGE_PROP = prop("array", "Optional [start, end] line range, 1-indexed and inclusive; end -1"
                  " means to the end of the file.",
                  items={"type": "integer"}, minItems=2, maxItems=2)


class CallContext:
    """What a handler may use besides its arguments: settings, scope, cancellation,
    a progress callback (a no-op unless the client asked for progress), the
    server's HelperPool, where searches and wait_for matches run, and its FileGuards."""

    def __init__(self, config, policy, cancelled=None, progress=None, helpers=None, client="",
                 sandbox=None, files=None, lsp=None):
        self.config = config
        self.lsp = lsp                          # the server's LangServers (None: no verdicts)
        self.files = files or FileGuards()      # edit locks: the server's, shared by its sessions
        self.policy = policy
        self.helpers = helpers
        self.client = client            # clientInfo.name of this request's client ('' when unknown)
        self.sandbox = sandbox or Sandbox.off()
        self.cancelled = cancelled or threading.Event()
        self.wants_progress = progress is not None
        self.progress = progress or (lambda text: None)


def text_block(text):
    """A text content block."""
    return {"type": "text", "text": text}


def resolve_checked(session, ctx, path, name="path"):
    """The one resolver for cwd-relative tools: canonical path, scope-checked."""
    return ctx.policy.check(ctx.policy.resolve(session.get_cwd(), path, name), path)


def stopped_why(why):
    """How a job run in a helper ended early, in words: HelperPool.run's 'deadline' or
    'cancelled'."""
    return "stopped after %g s" % SEARCH_TIMEOUT_S if why == "deadline" else "cancelled"


def read_on(body, notice):
    """A cut result: the line that says it was cut and how to read on, first and last."""
    return "%s\n%s\n%s" % (notice, body, notice) if notice else body


def search_root(session, ctx, shown):
    """Resolve and scope-check a search root: a SearchRoot."""
    real = resolve_checked(session, ctx, shown)
    try:
        st = os.stat(real)
    except OSError as e:
        raise io_error(e, shown)
    if stat.S_ISDIR(st.st_mode):
        return SearchRoot(real, True, None)
    fd, st = open_regular(real, shown, "searched")          # the inode the search must read
    os.close(fd)
    return SearchRoot(real, False, st.st_ino)


def search_cap(ctx):
    """How long a search's output may be: OUTPUT_MAX_CHARS within the result cap."""
    return min(OUTPUT_MAX_CHARS, ctx.config.max_result_chars - 500)


def check_pattern(value, name, code=INVALID_INPUT):
    """A pattern from the model within MAX_PATTERN_CHARS, or a ToolError that says so."""
    if len(value) > MAX_PATTERN_CHARS:
        raise ToolError(code, "%s is %d characters long; the limit is %d. Search for a shorter,"
                        " distinctive part" % (name, len(value), MAX_PATTERN_CHARS))


###############################################################################
# Tools: images and notebooks #################################################
###############################################################################
# What a file's bytes show a model, for view: an image as image content (sized for the
# client's model), a notebook as its cells with their outputs. The tools that show or
# edit them are in their own sections.


# What the model APIs behind the coding agents take (clientInfo.name prefix -> image
# types): no SVG anywhere, no GIF for Gemini, no BMP or ICO for any. Other clients get
# every image as image content; --svg overrides for SVG.
WEB_IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
CLIENT_IMAGE_TYPES = {"claude": WEB_IMAGE_TYPES, "codex": WEB_IMAGE_TYPES,
                      "gemini": ("image/png", "image/jpeg", "image/webp")}


def client_image_types(client):
    """The image types the model behind `client` (a clientInfo name) takes, or None
    when it is not a client known to refuse some."""
    name = client.lower()
    return next((types for prefix, types in CLIENT_IMAGE_TYPES.items() if name.startswith(prefix)),
                None)


def svg_as_text(ctx):
    """Whether an SVG goes to this call's client as its source text (--svg, or auto:
    for clients whose model API takes no SVG)."""
    svg = ctx.config.svg
    return svg == "text" or svg == "auto" and client_image_types(ctx.client) is not None


def image_result(ctx, shown, data, mime):
    """An image as MCP image content, within what a model API accepts (IMAGE_MAX_BYTES,
    IMAGE_MAX_SIDE, and the types the client's model takes)."""
    import base64
    size = image_size(data, mime)
    takes = client_image_types(ctx.client)
    # (SVG: svg_as_text decided)
    if takes is not None and mime not in takes and mime != "image/svg+xml":
        kind = mime.split("/")[1].upper().replace("X-ICON", "ICO")
        return ("%s is a %s image%s (%s); this client's model takes only %s images, so it"
                " is not shown. Convert it first, e.g. in bash: convert %s /tmp/image.png,"
                " then view that"
                % (shown, kind, " of %dx%d pixels" % size if size else "", human_size(len(data)),
                   ", ".join(t.split("/")[1].upper() for t in takes), shown))
    if len(data) > IMAGE_MAX_BYTES:
        raise ToolError(FILE_TOO_LARGE, "%s is a %s image of %s; a model API takes images up to"
                        " %s. Shrink it first, e.g. in bash: convert %s -resize 50%%"
                        " /tmp/small.png, then view that"
                        % (shown, mime, human_size(len(data)), human_size(IMAGE_MAX_BYTES), shown))
    if size and max(size) > IMAGE_MAX_SIDE:
        raise ToolError(INVALID_INPUT, "%s is %dx%d pixels; a model API takes at most %d a side."
                        " Shrink it first, e.g. in bash: convert %s -resize %dx%d /tmp/small.png,"
                        " then view that"
                        % (shown, size[0], size[1], IMAGE_MAX_SIDE, shown, IMAGE_MAX_SIDE,
                           IMAGE_MAX_SIDE))
    return [{"type": "image", "data": base64.b64encode(data).decode("ascii"), "mimeType": mime}]


def image_size(data, mime):
    """(width, height) read from an image's header (a WebP's VP8X, VP8 or VP8L chunk; a
    JPEG's first start-of-frame marker), or None when it cannot be told."""
    try:
        if mime == "image/png" and data[12:16] == b"IHDR":
            return struct.unpack(">II", data[16:24])
        if mime == "image/gif":
            return struct.unpack("<HH", data[6:10])
        if mime == "image/bmp":
            w, h = struct.unpack("<ii", data[18:26])
            return w, abs(h)
        if mime == "image/x-icon":
            return data[6] or 256, data[7] or 256
        chunk = data[12:16] if mime == "image/webp" else None
        if chunk == b"VP8X":
            return (1 + int.from_bytes(data[24:27], "little"),
                    1 + int.from_bytes(data[27:30], "little"))
        if chunk == b"VP8 ":
            w, h = struct.unpack("<HH", data[26:30])
            return w & 0x3FFF, h & 0x3FFF
        if chunk == b"VP8L":
            b = int.from_bytes(data[21:25], "little")
            return (b & 0x3FFF) + 1, ((b >> 14) & 0x3FFF) + 1
        i = 2
        while mime == "image/jpeg" and i + 9 < len(data) and data[i] == 0xFF:
            marker, length = data[i + 1], struct.unpack(">H", data[i + 2:i + 4])[0]
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                h, w = struct.unpack(">HH", data[i + 5:i + 9])
                return w, h
            i += 2 + length
    except (struct.error, IndexError):
        return None                       # a header cut short: the size cannot be told
    return None


NOTEBOOK_OUTPUT_CHARS = 2000               # one output's text shown in a notebook view


class Notebook:
    """A notebook's JSON text and its cells: the cell dicts, the (start, end) offsets of
    each cell object in the text (spans) and the offset of the cells array's ']'
    (array_end). ValueError when the text is not a notebook (JSON with a 'cells' array)."""

    def __init__(self, text):
        self.text = text
        dec, ws = json.JSONDecoder(), re.compile(r"[ \t\n\r]*")

        def skip(i):
            """The first non-blank at or after i: its offset and character ('' at the end)."""
            i = ws.match(text, i).end()
            return i, text[i:i + 1]
        i, c = skip(0)
        if c != "{":
            raise ValueError("not a JSON object")
        i, c = skip(i + 1)
        while c != "}":
            key, i = dec.raw_decode(text, i)
            i, c = skip(i)
            if c != ":":
                raise ValueError("expected ':' at offset %d" % i)
            i, c = skip(i + 1)
            if key == "cells":
                if c != "[":
                    raise ValueError("'cells' is not an array")
                self.cells, self.spans = [], []
                j, c = skip(i + 1)
                while c != "]":
                    cell, end = dec.raw_decode(text, j)
                    if not isinstance(cell, dict):
                        raise ValueError("cell %d is not an object" % (len(self.cells) + 1))
                    self.cells.append(cell)
                    self.spans.append((j, end))
                    j, c = skip(end)
                    if c == ",":
                        j, c = skip(j + 1)
                    elif c != "]":
                        raise ValueError("expected ',' or ']' at offset %d" % j)
                self.array_end = j
                return
            _, i = dec.raw_decode(text, i)
            i, c = skip(i)
            if c == ",":
                i, c = skip(i + 1)
        raise ValueError("it has no 'cells' array")

    @staticmethod
    def joined(value):
        """A cell's source, or an output's text, as one string (it may be stored as a list of
        lines)."""
        return "".join(value) if isinstance(value, list) else str(value)

    # -- view ------------------------------------------------------------------
    def render(self, ctx, shown, vr):
        """view of the notebook: content blocks (text, and images of outputs) for the cells
        in `vr` (cell numbers, from 1), within the result cap; a cut one says how to read on.
        An output image goes after the text so far, or a line says why it is not shown."""
        cells = self.cells
        start, end = vr or (1, -1)
        last = len(cells) if end == -1 else min(end, len(cells))
        if start > max(len(cells), 1):
            raise ToolError(INVALID_INPUT, "view_range counts cells for a notebook: %s has %d; give"
                            " a start between 1 and %d" % (shown, len(cells), max(len(cells), 1)))
        blocks, size = [], 0
        parts = ["%s: notebook, %d cells (view_range counts cells)" % (shown, len(cells))]
        cap = ctx.config.max_result_chars - 600
        for k in range(start, last + 1):
            piece, images = self.rendered_cell(k)
            if size + len(piece) > cap and k > start:
                notice = "[cells %d-%d of %d shown; read on with view_range [%d, %d]]" % (
                    start, k - 1, len(cells), k, end)
                return [text_block(notice)] + blocks + [text_block("\n".join(parts)),
                                                        text_block(notice)]
            size += len(piece)
            parts.append(piece)
            for mime, data in images:
                try:
                    image = image_result(ctx, "%s cell %d" % (shown, k), data, mime)
                except ToolError as e:
                    image = "[output image not shown: %s]" % e.message
                if isinstance(image, str):          # why not, or a type its model does not take
                    parts.append(image)
                else:
                    blocks += [text_block("\n".join(parts))] + image
                    parts = []
        if parts:
            blocks.append(text_block("\n".join(parts)))
        return blocks

    def rendered_cell(self, k):
        """(text, [(mime, data) of its output images]) of cell number k: a header line (its
        number, type, id and execution count), its numbered source, its outputs."""
        cell = self.cells[k - 1]
        bits = ["[cell %d] %s" % (k, cell.get("cell_type", "?"))]
        if cell.get("id"):
            bits.append("id %s" % cell["id"])
        if cell.get("cell_type") == "code":
            bits.append("execution_count %s" % cell.get("execution_count"))
        source = self.joined(cell.get("source", "")).split("\n")
        piece = [" · ".join(bits), number_lines([clip_line(line) for line in source], 1)]
        images = []
        outputs = cell.get("outputs")
        for out in outputs if isinstance(outputs, list) else []:
            text_out, image = self.output(out)
            if text_out:
                piece.append(text_out)
            if image:
                images.append(image)
        return "\n".join(piece), images

    @classmethod
    def output(cls, out):
        """(text or '', (mime, image bytes) or None) of one cell output; texts are cut at
        NOTEBOOK_OUTPUT_CHARS with a line saying so."""
        import base64

        def clip(text):
            text = text.rstrip("\n")
            if len(text) <= NOTEBOOK_OUTPUT_CHARS:
                return text
            return "%s\n... [%d characters in all; the first %d shown]" % (
                text[:NOTEBOOK_OUTPUT_CHARS], len(text), NOTEBOOK_OUTPUT_CHARS)
        if not isinstance(out, dict):
            return "", None
        kind = out.get("output_type")
        if kind == "stream":
            text = clip(cls.joined(out.get("text", "")))
            return "--- %s ---\n%s" % (out.get("name", "stream"), text), None
        if kind == "error":
            tb = [terminal_text(str(l)) for l in out.get("traceback", [])][-6:]
            return "--- error ---\n%s: %s\n%s" % (out.get("ename"), out.get("evalue"),
                                                  clip("\n".join(tb))), None
        data = out.get("data") if isinstance(out.get("data"), dict) else {}
        for mime in ("image/png", "image/jpeg"):
            if mime in data:
                try:
                    raw = base64.b64decode(cls.joined(data[mime]), validate=False)
                except ValueError:
                    return "--- %s (not valid base64) ---" % mime, None
                return "--- %s ---" % mime, (mime, raw)
        if "text/plain" in data:
            return "--- result ---\n%s" % clip(cls.joined(data["text/plain"])), None
        return ("--- %s ---" % ", ".join(sorted(data)) if data else ""), None

    # -- notebook_edit -----------------------------------------------------------
    def find(self, args, shown, mode):
        """The index (from 0) of the cell named by cell_id or cell_number (from 1); for an
        insert, -1 means 'at the top' when neither is given."""
        cells = self.cells
        if args.get("cell_id"):
            for k, cell in enumerate(cells):
                if cell.get("id") == args["cell_id"]:
                    return k
            raise ToolError(INVALID_INPUT, "%s has no cell with id %r (ids: %s)" % (
                shown, args["cell_id"], ", ".join(str(c.get("id")) for c in cells[:30]) or "none"))
        if args.get("cell_number") is not None:
            n = args["cell_number"]
            if not 1 <= n <= len(cells):
                raise ToolError(INVALID_INPUT, "cell_number %d is outside %s's cells (1 to %d, as"
                                " view shows them)" % (n, shown, len(cells)))
            return n - 1
        if mode == "insert":
            return -1
        raise ToolError(INVALID_INPUT,
                        "say which cell: cell_id or cell_number (as view shows them)")

    def edited(self, k, mode, args):
        """The text with cell k replaced, deleted, or a new cell inserted after it, written
        with the indentation the file has (the whitespace before a cell's '{' on its line,
        the unit inside it; none for a file written without newlines)."""
        text, spans = self.text, self.spans
        if mode == "delete":
            start, end = spans[k]
            if k + 1 < len(spans):
                # its comma and the space before the next cell
                end = spans[k + 1][0]
            elif k > 0:
                start = spans[k - 1][1]                 # the comma before the last cell
            return text[:start] + text[end:]
        base, unit = "  ", 1
        if spans:
            start, end = spans[0]
            base = text[text.rfind("\n", 0, start) + 1:start]
            inner = re.search(r"\n([ \t]*)\"", text[start:end])
            base, unit = ("", None) if inner is None or base.strip() else (
                base, max(1, len(inner.group(1)) - len(base)))
        newline, colon = ("", ":") if unit is None else ("\n" + base, ": ")
        body = json.dumps(self.new_cell(k, mode, args), indent=unit, ensure_ascii=False,
                          separators=(",", colon))
        body = body.replace("\n", "\n" + base)
        if mode == "replace":
            start, end = spans[k]
        elif k >= 0:
            start = end = spans[k][1]
            body = "," + newline + body
        elif spans:                                     # at the top
            start = end = spans[0][0]
            body += "," + newline
        else:
            start = end = self.array_end
            body = newline + body
        return text[:start] + body + text[end:]

    def new_cell(self, k, mode, args):
        """The cell that replaces cell k (its key order and metadata kept) or is inserted
        after it: the new source in nbformat's list of lines; a code cell's outputs and
        execution count cleared; a new cell gets an id when the others have one."""
        if args.get("new_source") is None:
            raise ToolError(INVALID_INPUT, "new_source is needed to %s a cell" % mode)
        cell_type = args.get("cell_type")
        if mode == "replace":
            cell = dict(self.cells[k])
            cell_type = cell_type or cell.get("cell_type", "code")
        elif not cell_type:
            raise ToolError(INVALID_INPUT, "cell_type (code, markdown or raw) is needed to insert a"
                            " cell")
        else:
            cell = {"cell_type": cell_type}
            if any("id" in c for c in self.cells):
                cell["id"] = os.urandom(4).hex()
            cell["metadata"] = {}
        cell.update(cell_type=cell_type, source=args["new_source"].splitlines(True))
        if cell_type == "code":
            cell.update(execution_count=None, outputs=[])
        else:
            cell.pop("execution_count", None)
            cell.pop("outputs", None)
        return cell


###############################################################################
# Tools: view #################################################################
###############################################################################
# view: a file with line numbers (streamed for a range), a directory two levels deep,
# an image as image content; notebooks render through the notebook section.

VIEW_DESC = ("View, open or read a file's contents with line numbers (cat -n style), list a "
             "directory two levels deep, see an image (PNG, JPEG, GIF, WebP, SVG), read a PDF's "
             "text page by page, or read Word, Excel, PowerPoint and OpenDocument files (.docx "
             ".xlsx .pptx .odt .ods .odp) as Markdown. Files over {0:,} lines show their first "
             "{0:,} lines unless view_range is given; lines over {1:,} characters are cut. A cut "
             "result starts and ends with a line giving the view_range that reads on. Binary files "
             "are reported by size only. Viewing a file is required before editing it.").format(
                 VIEW_MAX_LINES, VIEW_MAX_LINE_CHARS)


PAGES_PROP = prop("string", "For a PDF: the page or pages to read, \"3\" or \"3-5\" (default:"
                          " all).")


@tool("view", VIEW_DESC,
      obj({"path": PATH_PROP, "view_range": RANGE_PROP, "pages": PAGES_PROP}, ["path"]),
      notes("View file or directory", read_only=True, idempotent=True), modes=DEFAULT,
      hint="read file, image, pdf, directory")
def tool_view(session, args, ctx):
    """view: a file's numbered lines (a view_range of them), an image, a notebook's
    cells, or a directory's tree two levels deep (a view_range is for files only). A
    file over --max-file-size is refused saying what to do instead; an SVG goes as its
    source text (with a note saying why) to a client whose model takes no SVG images; a
    notebook that is not valid JSON is shown as text after a note."""
    shown, vr = args["path"], args.get("view_range")
    real = resolve_checked(session, ctx, shown)
    if vr is not None:
        check_view_range(vr)
    try:
        fd, st = open_regular(real, shown)
    except ToolError as e:
        if e.detail != "directory":
            raise
        if vr is not None:
            raise ToolError(INVALID_INPUT,
                            "view_range applies to files, and %s is a directory" % shown)
        return list_tree(real, ctx.policy, shown)
    limit, note = ctx.config.max_file_size, ""
    if ctx.lsp:
        ctx.lsp.warm(real)
    with os.fdopen(fd, "rb") as fh:
        if st.st_size > limit:
            raise ToolError(FILE_TOO_LARGE, "%s is %s; the limit is %s (--max-file-size). Use grep"
                            " to search it, or raise --max-file-size"
                            % (shown, human_size(st.st_size), human_size(limit)))
        try:
            head = fh.read(SNIFF_BYTES)
            kind, mime = sniff(head, real)
            if mime == "image/svg+xml" and svg_as_text(ctx):
                kind, note = "text", ("(%s is an SVG image, shown as its source: this client's"
                                      " model takes no SVG images)\n" % shown)
            if head.startswith(b"PK\x03\x04") and os.path.splitext(real)[1].lower() in DOC_FORMATS:
                return document_view(ctx, real, st, shown, vr)
            if pdf_sniff(head, real):
                return pdf_view(ctx, real, st, shown, vr, args.get("pages"))
            if args.get("pages") is not None:
                raise ToolError(INVALID_INPUT,
                                "pages applies to PDF files, and %s is not one; use view_range"
                                % shown)
            if kind == "binary":
                return "Binary file (%s): %s is not shown as text" % (human_size(st.st_size), shown)
            if kind == "image" or real.endswith(".ipynb"):
                # (none left after a short head)
                data = head + read_fd(fh.fileno(), limit - len(head), shown)
                try:
                    whole = image_result(ctx, shown, data, mime) if kind == "image" else \
                        Notebook(data.decode("utf-8", "replace")).render(ctx, shown, vr)
                    session.mark_viewed(real, Seen(st, digest_of(data)))
                    return whole
                except (ValueError, RecursionError) as e:
                    note = "(%s is not a valid notebook (%s); shown as text)\n" % (
                        shown, shorten(str(e), 120))
            fh.seek(0)
            reader = LineReader(fh, max(limit, st.st_size) + 1, whole=True)
            text = note + numbered(reader, vr, shown, ctx.config.max_result_chars - len(note))
            seen = Seen(st, reader.digest())
        except FileTooLarge as e:
            raise too_large(shown, e.args[0], limit, more=True)
        except OSError as e:
            raise io_error(e, shown)
    session.mark_viewed(real, seen)
    return text


def check_view_range(vr):
    """ToolError unless view_range [start, end] starts at 1 or later and ends at or after
    its start (or at -1: the end of the file)."""
    if vr[0] < 1:
        raise ToolError(INVALID_INPUT,
                        "view_range start %d is below 1; lines are numbered from 1" % vr[0])
    if vr[1] != -1 and vr[1] < vr[0]:
        raise ToolError(INVALID_INPUT, "view_range [%d, %d] ends before it starts;"
                        " give start <= end, or end = -1 for the end of the file" % tuple(vr))


def document_view(ctx, real, st, shown, vr):
    """An office document's Markdown, read in a search helper (from the very file `st` is
    the stat of), numbered as its lines (view_range pages them), after a line saying what
    it is."""
    text = read_document(ctx, {"op": "document", "path": real, "file": [st.st_dev, st.st_ino]},
                         shown)
    note = "(%s: %s, shown as Markdown; line numbers are the rendering's, for view_range)\n" % (
        shown, DOC_FORMATS[os.path.splitext(real)[1].lower()])
    return note + numbered_text(text, vr, shown, ctx.config.max_result_chars - len(note))


def read_document(ctx, job, shown):
    """What a document job (an office file's or a PDF's) answers, read in a search helper;
    its errors name the file."""
    try:
        items, why = ctx.helpers.run(job, ctx.cancelled)
    except ToolError as e:
        raise ToolError(e.code, "%s: %s" % (shown, e.message))
    if not items:
        raise ToolError(IO_ERROR,
                        "reading %s was %s before it was done" % (shown, stopped_why(why)))
    return items[0]


def numbered_text(text, vr, shown, cap):
    """`text`'s lines numbered as view numbers a file's (a view_range of them), within `cap`."""
    data = text.encode("utf-8", "surrogateescape")
    return numbered(LineReader(io.BytesIO(data), len(data) + 1), vr, shown, cap)


def pdf_view(ctx, real, st, shown, vr, pages):
    """A PDF's text, read in a search helper (from the very file `st` is the stat of): a
    line saying what it is, then each page
    after a marker. Without `pages`, the pages that fit in a result, and which to ask
    for next; view_range numbers the lines of what is rendered."""
    m = re.match(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?$", "1" if pages is None else pages)
    first, last = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if first < 1 or last < first:
        raise ToolError(INVALID_INPUT, "pages %r is not a page or a range of them; give \"3\" or"
                        " \"3-5\" (pages are numbered from 1)" % (pages,))
    job = {"op": "pdf", "path": real, "file": [st.st_dev, st.st_ino], "first": first,
           "last": last if pages else None, "asked": pages, "limit": ctx.config.max_file_size}
    answer = read_document(ctx, job, shown)
    count, title, texts = answer["count"], answer["title"], answer["texts"]
    head = "(%s: PDF, %s%s; line numbers are the rendering's, for view_range)\n" % (
        shown, plural(count, "page"), ", title \"%s\"" % shorten(title, 200) if title else "")
    cap = ctx.config.max_result_chars - len(head) - 400
    parts, size, lines, shown_last = [], 0, 0, first - 1
    for k, text in enumerate(texts):
        page = "--- page %d of %d ---\n%s\n" % (
            first + k, count,
            text.strip("\n") or "[no text on this page: a scanned page, or only drawings]")
        lines += page.count("\n")
        size += len(page) + 9 * page.count("\n")          # (what numbering adds to each line)
        if vr is None and parts and (size > cap or lines > VIEW_MAX_LINES):
            break
        parts.append(page)
        shown_last = first + k
    body = numbered_text("".join(parts), vr, shown, ctx.config.max_result_chars - len(head))
    if shown_last < first + len(texts) - 1:
        body += "\n[pages %d-%d of %d shown; read on with pages \"%d-%d\"]" % (
            first, shown_last, count, shown_last + 1,
            min(count, shown_last + 1 + shown_last - first))
    return head + body


def numbered(reader, vr, shown, cap):
    """Stream a text file into `cat -n` form: memory stays flat whatever its size, and
    the answer stops within `cap` characters; a cut one starts and ends with the
    view_range that reads on. Without a range, a file over VIEW_MAX_LINES shows its
    first lines; a range past the end is INVALID_INPUT."""
    lines, size = [], 0
    start, end = vr or (1, -1)
    n = 0
    for raw, more in reader:
        n += 1
        if n < start:
            continue
        if vr is None and len(lines) == VIEW_MAX_LINES:
            total = n + reader.count_rest()
            return read_on(number_lines(lines, 1),
                           "[Truncated: file has %d lines. Use view_range to read specific sections"
                           " (e.g. [%d, %d]); lines 1-%d are shown. outline lists its definitions"
                           " with their line ranges.]" % (
                               total, VIEW_MAX_LINES + 1, min(total, 2 * VIEW_MAX_LINES),
                               VIEW_MAX_LINES))
        line = display_line(raw, more)
        size += len(line) + 8
        if size > cap - 400 and lines:
            return read_on(number_lines(lines, start), "[cut at %d characters after line %d; read"
                           " on with view_range [%d, %d]]" % (cap, n - 1, n, end))
        lines.append(line)
        if n == end:
            break
    if not lines:
        if vr is None:
            return "(%s is empty)" % shown
        raise ToolError(INVALID_INPUT, "view_range start %d exceeds the file's %d lines; give a"
                        " start between 1 and %d" % (start, n, max(n, 1)))
    return number_lines(lines, start)


class _ListingFull(Exception):
    pass


def list_tree(root, policy, shown):
    """Two levels below `root`, sorted, directories marked '/', links as 'name -> target'."""
    out = []

    def walk(directory, rel, level):
        try:
            entries = list_entries(directory)
        except OSError as e:
            if level == 1:
                raise io_error(e, shown)
            out.append("%s  [unreadable: %s]" % (rel or ".", e.strerror))
            return
        for name, is_dir, link in entries:
            path = child_prefix(directory) + name
            if name in SKIP_DIRS or policy.is_denied(path):
                continue
            if len(out) >= LISTING_MAX_ENTRIES:
                raise _ListingFull()
            if link is not None:
                out.append("%s%s -> %s" % (rel, name, link))
            elif is_dir:
                out.append(rel + name + "/")
                if level < LISTING_DEPTH:
                    walk(path, rel + name + "/", level + 1)
            else:
                out.append(rel + name)

    try:
        walk(root, "", 1)
        note = ""
    except _ListingFull:
        note = ("\n[listing cut at %d entries; view a subdirectory to see more]"
                % LISTING_MAX_ENTRIES)
    header = "%s/ (%d levels deep; .git and node_modules left out)" % (
        root.rstrip("/"), LISTING_DEPTH)
    return header + "\n" + ("\n".join(out) if out else "(empty directory)") + note


###############################################################################
# Tools: outline ##############################################################
###############################################################################
# outline: a file's definitions with line ranges, or each source file's top-level ones
# under a directory, parsed in a search helper (the outline engine, in Search) where
# the search deadline and a cancel stop it.

OUTLINE_DESC = ("Show a file's structure before reading it: its definitions (classes, functions, "
                "methods, types, headings, top-level keys) in order, one per line, with their line "
                "ranges and nesting. On a directory: the top-level definitions of each source file "
                "under it (gitignore-aware), to map a repository. Then read one with view and "
                "view_range [first, last]. Languages: %s.")


@tool("outline", OUTLINE_DESC % OUTLINE_LANGUAGES, obj({
    "path": PATH_PROP,
    "offset": prop("integer", "How many to skip: a cut outline's read-on notice gives it."),
    "symbol": prop("string", "A name in the file: where it is defined and used, by the language "
                   "server where one runs for the file, else its outline entries."),
}, ["path"]), notes("Outline a file or directory", read_only=True, idempotent=True),
      hint="file structure, symbols")
def tool_outline(session, args, ctx):
    """outline: the definitions of a file, or the top-level ones of each source file
    under a directory, bounded by the result cap with a read-on notice."""
    shown, offset = args["path"], args.get("offset") or 0
    if offset < 0:
        raise ToolError(INVALID_INPUT, "offset %d must be 0 or more" % offset)
    root = search_root(session, ctx, shown)
    if not root.is_dir:
        if Outline.language(root.real) is None:
            raise ToolError(INVALID_INPUT, "%s is in no language outline knows (by its"
                            " extension: %s); view or grep it instead"
                            % (shown, OUTLINE_LANGUAGES))
        if ctx.lsp:
            ctx.lsp.warm(root.real)
    items, why = ctx.helpers.run({"op": "outline", "root": root, "policy": policy_spec(ctx.policy),
                                  "max_size": ctx.config.max_file_size,
                                  "page": [offset, search_cap(ctx) - 400]},
                                 ctx.cancelled)
    items = list(map(file_outline, items))
    if root.is_dir:
        return directory_outline(shown, items, why, offset, search_cap(ctx))
    if not items:
        raise ToolError(IO_ERROR, "the outline of %s was %s before it was done" % (
            shown, stopped_why(why)))
    one = items[0]
    if one.refused:
        raise ToolError(one.refused, "%s: %s" % (shown, one.note))
    symbol, places = args.get("symbol"), None
    if symbol:                  # its entries, and where it is defined and used by the server
        word = re.compile(r"(?<!\w)%s(?!\w)" % re.escape(symbol))
        one = one._replace(entries=[e for e in one.entries if word.search(e.signature)])
        places = ctx.lsp and ctx.lsp.places(root.real, word,
                                            next((e.first for e in one.entries), 1))
    rows, cwd = outline_rows(one.entries, one.lines), session.get_cwd()
    if places is not None:      # (a line used twice is one row)
        rows = list(dict.fromkeys("%s %s:%d" % (
            kind, os.path.relpath(path, cwd) if is_within(path, cwd) else path, n)
            for kind, path, n in places))
    parts = ["%s: %s, %d lines, %d definitions%s" % (
        shown, one.lang, one.lines, len(one.entries), " (%s)" % one.note if one.note else "")]
    cut = outline_page(parts, rows, offset, search_cap(ctx),
                       "[outline cut at entry {0} of %d; read on with offset={0}]" % len(rows))
    if not cut:
        parts.append("Read a definition with view and view_range [first, last]%s." % (
            ", e.g. view_range [%d, %d]" % one.entries[0][:2] if one.entries else
            " (no definitions were found)"))
    if symbol and places is None:
        parts.append("[no language server's answer: grep %s as a whole word]" % symbol)
    return read_on("\n".join(parts), cut)


def outline_page(parts, rows, offset, cap, cut):
    """Add rows from number `offset` (from 0) to parts while they fit in `cap` (less 400
    characters), one at least; where one does not, cut.format(its number) is the read-on
    notice returned (else None)."""
    size = 0
    for k, row in enumerate(rows[offset:], offset):
        if parts and size + len(row) > cap - 400:
            return cut.format(k)
        parts.append(row)
        size += len(row) + 1
    return None


def directory_outline(shown, items, why, offset, cap):
    """outline's answer for a directory: each source file with its top-level
    definitions, from file `offset` (in the walk's order), within `cap` characters. The
    helper stops at the file that fills the page, so a cut page does not count the files
    after it."""
    if offset > len(items):
        raise ToolError(INVALID_INPUT, "offset %d is past the %d source files outlined under %s" % (
            offset, len(items), shown))
    parts = []
    cut = outline_page(parts, [outline_block(one) for one in items], offset, cap,
                       "[outline cut after file {0}; read on with offset={0}]")
    if cut:
        return read_on("\n".join(parts), cut)
    if not items:
        parts.append("No source files under %s (outline reads %s)" % (shown, OUTLINE_LANGUAGES))
    if why:
        parts.append("[outline %s: the files above are those read so far; outline a subdirectory]"
                     % (stopped_why(why)))
    parts.append("Each file's top-level definitions; outline a file for all of them, and read one"
                 " with view and view_range [first, last].")
    return "\n".join(parts)


###############################################################################
# Tools: edits ################################################################
###############################################################################
# str_replace, multi_edit, create_file and the compat str_replace_editor (with insert):
# each loads the file as it is (view-before-edit, unchanged since seen), finds its text,
# and writes through the one atomic writer under the file's edit lock.


# -- the one matcher ------------------------------------------------------------------
# Every edit tool finds its text here, level by level, a level tried only when the
# stricter ones found nothing: exact (an LF old_str also in a CRLF file), then whole lines
# ignoring trailing whitespace; indentation (a consistent mapping of old_str's onto the
# file's: a shift, tabs written as spaces, another unit); whitespace at both ends of lines
# (Codex's last seek pass); typographic punctuation; whitespace inside lines; blank lines
# that one side has and the other lacks. Past trailing whitespace a level takes only a
# place that is unique at the most relaxed level too (or every place, with replace_all).
# Then the three-way merge (EditMerge): the edit is the difference between old_str and
# new_str, applied to the file's own lines where old_str was found.

PUNCT_ASCII = {ord(c): to for to, chars in (
    ("'", "\u2018\u2019\u201a\u201b\u2032"),
    ('"', "\u201c\u201d\u201e\u201f\u2033"),
    ("-", "\u2010\u2011\u2012\u2013\u2014\u2015\u2212"),
    (" ", "\u00a0\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000"),
    ("...", "\u2026"),
    ("", "\u200b\u200c\u200d\u2060\ufeff")) for c in chars}
WHITESPACE_RUN = re.compile(r"\s+")


def text_lines(s, ended=True):
    """s split into lines (CRLF as LF); when `ended`, a final newline ends the last line
    rather than starting an empty one."""
    lines = s.replace("\r\n", "\n").split("\n")
    if ended and s.endswith("\n"):
        lines.pop()
    return lines


def split_cr(line):
    """(a line of text split at LF without its CR, that CR or '')."""
    return (line[:-1], "\r") if line.endswith("\r") else (line, "")


def is_word(ch):
    """Whether `ch` is a character of a word (a run of whitespace between two of them
    is one space to the matcher, never nothing)."""
    return ch.isalnum() or ch == "_"


def squeezed(line):
    """A line as the inner-whitespace level sees it: typography folded, its ends stripped,
    a run of whitespace between two word characters one space, any other run gone."""
    s = line.translate(PUNCT_ASCII).strip()
    # (stripped: every run has a character on either side)
    return WHITESPACE_RUN.sub(
        lambda m: " " if is_word(s[m.start() - 1]) and is_word(s[m.end()]) else "", s)


def line_key(line):
    """What every level agrees on: the line's characters, typography folded, without
    any whitespace (equal keys are needed for a match at any level; '' = blank)."""
    return "".join(line.translate(PUNCT_ASCII).split())


# name: what the result says; norm: how lines compare (str: as they are); maps_indent:
# whether indentation must map as a slip does
MatchLevel = namedtuple("MatchLevel", "name norm maps_indent")
MATCH_LEVELS = (
    MatchLevel("exactly", str, False),
    MatchLevel("ignoring trailing whitespace", str.rstrip, False),
    MatchLevel("ignoring indentation", str.strip, True),
    MatchLevel("ignoring whitespace at both ends of lines", str.strip, False),
    MatchLevel("ignoring typographic quotes, dashes and spaces",
               lambda s: s.translate(PUNCT_ASCII).strip(), False),
    MatchLevel("ignoring whitespace inside lines", squeezed, False),
    MatchLevel("ignoring blank lines", squeezed, False),
)
BLANK_LEVEL = len(MATCH_LEVELS) - 1
# exactly and trailing whitespace: unique at their own level is enough
STRICT_LEVELS = 2


def leading(line):
    """A line's indentation."""
    return line[:len(line) - len(line.lstrip())]


def trailing(line):
    """A line's trailing whitespace."""
    return line[len(line.rstrip()):]


def indent_map(want, region):
    """old_str's indentation -> the file's, learnt from the lines matched, when it is
    one of the slips models make: levels shifted, tabs written as spaces, another
    width of unit (2 spaces for 4), every level alike (indent_unit); else None:
    then the lines only look alike."""
    to_file = {}
    for w, f in zip(want, region):
        a, b = leading(w), leading(f)
        if w.strip() and f.strip() and to_file.setdefault(a, b) != b:
            return None
    # deeper in old_str, deeper in the file (so no two map onto one of the file's)
    pairs = sorted((len(a.expandtabs(4)), len(b.expandtabs(4))) for a, b in to_file.items())
    if any(q[1] <= p[1] for p, q in zip(pairs, pairs[1:])):
        return None
    return to_file if indent_unit(to_file) else None


# A unit of indentation: its width in columns, and how it is written (a tab, 2 spaces, ...)
IndentUnit = namedtuple("IndentUnit", "columns text")


def indent_unit(mapping):
    """IndentUnit(old_str's unit of indentation in columns, the file's unit as text) when
    every step between the levels of `mapping` is a whole number of old_str's units and
    the same number of the file's; IndentUnit(0, '') when one level gives no unit; else
    None."""
    levels = sorted((len(a.expandtabs(4)), b) for a, b in mapping.items())
    steps = [(n2 - n1, f2, f1) for (n1, f1), (n2, f2) in zip(levels, levels[1:])]
    if not steps:
        return IndentUnit(0, "")
    unit, top, low = min(steps)
    step = top[len(low):]           # (where top does not start with low, the loop refuses)
    if len(set(step)) != 1:
        return None
    if "".join(f for _, f in levels)[:1] != step[0]:
        # the file's shallowest indentation starts otherwise: spaces that align under
        # tabs, not the file's unit
        return None
    if unit not in (2, 4, 8):
        # no unit a model writes (0: two indentations as wide as each other): one line is
        # off, not the unit
        return None
    for dn, f2, f1 in steps:
        if dn % unit or f2 != f1 + step * (dn // unit):
            return None
    # as a ratio: two tabs for 8 columns are a tab for 4
    g = math.gcd(unit, len(step))
    return IndentUnit(unit // g, step[0] * (len(step) // g))


def indent_step(lines, counted=None):
    """The IndentUnit `lines` use most: the commonest step by which a line is indented
    deeper than the line with text before it (only into the lines whose indexes are
    `counted`, when given, a step between two of those counting twice: how the model
    nests the lines it writes shows its unit best); None when no line is, or when two
    widths are as common."""
    if counted is None:
        # every line: every step weighs 2, which ranks the steps as weighing 1 does
        counted = range(len(lines))
    steps, prev, last = Counter(), None, None
    for k, line in enumerate(lines):
        if line.strip():
            lead = leading(line)
            if prev is not None and lead.startswith(prev) and k in counted:
                step = lead[len(prev):]
                if len(set(step)) == 1:             # one character repeated: deeper
                    steps[step] += 2 if last in counted else 1
            prev, last = lead, k
    top = steps.most_common(2)
    if not top or (len(top) > 1 and top[0][1] == top[1][1] and len(top[0][0].expandtabs(4)) !=
                   len(top[1][0].expandtabs(4))):
        return None
    return IndentUnit(len(top[0][0].expandtabs(4)), top[0][0])


def with_indent(line, mapping, place_unit=None):
    """A new line with its indentation translated by `mapping`: the longest known
    prefix is mapped, and what lies deeper is turned from old_str's units of
    indentation into the file's (4 spaces to a tab, or to 2 spaces) - the unit learnt from
    the levels of `mapping`, or where it has one level only `place_unit` (old_str's unit in
    columns, the file's as text); a line shallower than every known level loses as
    many of the file's units. None when the mapping cannot tell."""
    have = leading(line)
    level_unit = indent_unit(mapping)           # (indent_map's mappings all have one)
    torn = level_unit.columns and place_unit and (
        level_unit.text[:1] != place_unit.text[:1]
        or level_unit.columns * len(place_unit.text) != place_unit.columns * len(level_unit.text))
    # torn: the place and the file disagree
    unit = level_unit if level_unit.columns or not place_unit else place_unit
    best = max((k for k in mapping if have.startswith(k)), key=len, default=None)
    if torn and have not in mapping:
        return None
    if best is None:
        return shallower(line, have, mapping, unit)
    extra = deeper_indent(have[len(best):], best, mapping, unit)
    return None if extra is None else mapping[best] + extra + line[len(have):]


def shallower(line, have, mapping, unit):
    """with_indent() of a line shallower than every level `mapping` knows: the nearest
    deeper level's, less as many of the file's units as it lies above it (None when the
    file's indentation there does not end so)."""
    deeper = min((k for k in mapping if k.startswith(have)), key=len, default=None)
    if deeper is None:
        return None
    extra = deeper[len(have):]
    cut = unit.text * (len(extra.expandtabs(4)) // unit.columns) if unit.columns and \
        len(extra.expandtabs(4)) % unit.columns == 0 else extra
    return mapping[deeper][:-len(cut)] + line.lstrip() if mapping[deeper].endswith(cut) else None


def deeper_indent(extra, best, mapping, unit):
    """The file's writing of `extra`, the indentation a line has past the known level
    `best`: in the file's units, or as tabs against spaces where one level shows how, or
    as it is where the mapping is a shift; None when it cannot be told."""
    if not extra:
        return extra
    if unit.columns and len(extra.expandtabs(4)) % unit.columns == 0:
        extra = unit.text * (len(extra.expandtabs(4)) // unit.columns)
    elif (len(set(best)) == len(set(mapping[best])) == 1 != len(set(best + mapping[best]))
          and set(extra) == set(best)
          and len(extra) * len(mapping[best]) % len(best) == 0):
        # one level known, tabs against spaces: as many of the file's as that level shows
        extra = mapping[best][0] * (len(extra) * len(mapping[best]) // len(best))
    elif not is_shift(mapping):
        # part of a unit the file writes otherwise: not known
        return None
    return extra


def is_shift(mapping):
    """Whether every indentation of `mapping` differs from the file's by one and the same
    prefix taken off or put on, and by nothing else (so what lies deeper is written
    alike on both sides)."""
    moves = set()
    for a, b in mapping.items():
        same = len(os.path.commonprefix([a[::-1], b[::-1]]))      # the common end
        moves.add((a[:len(a) - same], b[:len(b) - same]))
    return len(moves) <= 1 and all(not drop or not add for drop, add in moves)


class LineIndex:
    """A file's lines (without CR) as the matcher searches them: each line's key, and
    where each key stands among the non-blank lines, made once per text."""

    def __init__(self, plain):
        self.plain = plain
        self.keys = list(map(line_key, plain))
        self.nonblank = [i for i, k in enumerate(self.keys) if k]
        self.at = {}
        for p, i in enumerate(self.nonblank):
            self.at.setdefault(self.keys[i], []).append(p)

    def spans(self, want, start, eof, partial):
        """(i, j): the runs plain[i:j] whose non-blank lines have want's keys (blank lines
        of want at its ends taken from the file's blank lines around the run, as far as
        they go), at or after `start` (at the end, for eof), overlapping ones too (each
        is a place). With `partial`, want's last line may be the start of the file's line."""
        wkeys = list(map(line_key, want))
        words = list(filter(None, wkeys))                         # want's lines with text
        if not words:
            return []
        # the blank lines before the first and after the last
        lead, tail = wkeys.index(words[0]), wkeys[::-1].index(words[-1])
        nb, keys, m, out = self.nonblank, self.keys, len(words), []
        if partial and tail:
            return []
        for p in self.firsts(words, partial):
            i = nb[p]
            if i < start or not self.run_at(p, words, partial):
                continue
            a, b = self.widened(i, nb[p + m - 1] + 1, start, lead, tail)
            if eof and any(keys[b:]):
                continue
            out.append((a, b))
        return out

    def firsts(self, words, partial):
        """Where among the non-blank lines a run with the keys `words` may start: the lines
        with its first key (with `partial` and one key, the lines that start with it)."""
        if len(words) > 1 or not partial:
            return self.at.get(words[0], ())
        return [p for p, i in enumerate(self.nonblank) if self.keys[i].startswith(words[0])]

    def widened(self, i, j, start, lead, tail):
        """The run plain[i:j] with up to `lead` blank lines before it (not before `start`)
        and `tail` after it, as far as the file has them."""
        keys, a, b = self.keys, i, j
        while a > start and i - a < lead and not keys[a - 1]:
            a -= 1
        while b < len(keys) and b - j < tail and not keys[b]:
            b += 1
        return a, b

    def run_at(self, p, words, partial):
        """Whether the non-blank lines from the p-th on have the keys `words` (the last one
        the start of the file's line, with `partial`)."""
        nb, keys, m = self.nonblank, self.keys, len(words)
        if p + m > len(nb) or [keys[q] for q in nb[p:p + m - 1]] != words[:-1]:
            return False
        last = keys[nb[p + m - 1]]
        return last.startswith(words[-1]) if partial else last == words[-1]


def level_of(plain, want, i, j, partial):
    """The first level (an index of MATCH_LEVELS) at which want stands at plain[i:j], or
    None; with `partial` want's last line may be the start of the file's line."""
    region = plain[i:j]

    def same(norm, have, wanted):
        """Whether the lines `have` are `wanted` line by line as `norm` sees them."""
        return len(have) == len(wanted) and all(
            norm(a).startswith(norm(b)) if partial and n == len(have) - 1 else norm(a) == norm(b)
            for n, (a, b) in enumerate(zip(have, wanted)))
    for k, (_, norm, maps_indent) in enumerate(MATCH_LEVELS[:BLANK_LEVEL]):
        if same(norm, region, want) and (not maps_indent or indent_map(want, region) is not None):
            return k
    if same(squeezed, list(filter(str.strip, region)), list(filter(str.strip, want))):
        return BLANK_LEVEL
    return None


def find_lines(index, want, start=0, eof=False, partial=False):
    """(level, [(i, j)] there, [(i, j)] elsewhere) of the first level at which the lines
    `want` stand in the file (a LineIndex) at or after `start` (at the end, for eof):
    the places found there, in order, and past the strict levels the other places the
    most relaxed level sees, in no order (a place is unique only when nothing else looks
    like it); (None, [], []) when nowhere."""
    found = {}                                  # level: [(i, j)] found at it
    for i, j in index.spans(want, start, eof, partial):
        level = level_of(index.plain, want, i, j, partial)
        if level is not None:
            found.setdefault(level, []).append((i, j))
    if not found:
        return None, [], []
    level = min(found)
    there = found.pop(level)
    return level, there, sum(found.values(), []) if level >= STRICT_LEVELS else []


# -- the three-way merge ----------------------------------------------------------
def hunk_ops(lines):
    """(old lines, new lines, difflib-style opcodes) of a patch hunk's (kind, text) lines:
    each run of context lines is 'equal', each run of '-' and '+' lines between them one
    change."""
    old, new, ops = [], [], []
    for context, run in groupby(lines, key=lambda line: line[0] == " "):
        run = list(run)
        i, j = len(old), len(new)
        old += [text for kind, text in run if kind != "+"]
        new += [text for kind, text in run if kind != "-"]
        removes, adds = len(old) > i, len(new) > j
        tag = "equal" if context else "replace" if removes and adds else \
            "delete" if removes else "insert"
        ops.append((tag, i, len(old), j, len(new)))
    return old, new, ops


def paired_lines(olds, news):
    """For each changed new line (of news), the old line (index into olds) it was made
    from, or None: line by line when there are as many and each pair is alike, else by
    the most similar pairs, in order."""
    import difflib
    unpaired = [None] * len(news)

    def ratio(a, b):
        matcher = difflib.SequenceMatcher(None, a.strip()[:300], b.strip()[:300], autojunk=False)
        return matcher.ratio() if matcher.quick_ratio() >= 0.5 else 0.0
    if len(olds) == len(news) and all(ratio(a, b) >= 0.5 for a, b in zip(olds, news)):
        return list(range(len(olds)))
    if len(olds) * len(news) > 400:
        return unpaired
    # difflib's own cutoff for lines that were changed, not replaced
    best, at = 0.75, None
    for k, a in enumerate(olds):
        for m, b in enumerate(news):
            r = ratio(a, b)
            if r > best:
                best, at = r, (k, m)
    if at is None:
        return unpaired
    k, m = at
    left = paired_lines(olds[:k], news[:m])
    right = paired_lines(olds[k + 1:], news[m + 1:])
    return left + [k] + [a if a is None else a + k + 1 for a in right]


TextUnit = namedtuple("TextUnit", "canonical original solid")


def text_units(core):
    """[TextUnit] of a line's text: each character is a
    solid unit (typography folded: an ellipsis is three dots, the first carrying it),
    and each run of whitespace or of characters that fold to nothing a gap unit
    (canonical ' ' between two word characters, '' elsewhere), so that two texts the
    matcher sees as equal have the same solid units in the same order."""
    units, k = [], 0
    while k < len(core):
        folded = core[k].translate(PUNCT_ASCII)
        if folded.strip():
            units.append(TextUnit(folded[0], core[k], True))
            units.extend(TextUnit(c, "", True) for c in folded[1:])
            k += 1
            continue
        j = k
        while j < len(core) and not core[j].translate(PUNCT_ASCII).strip():
            j += 1
        run = core[k:j]
        after = core[j:j + 1].translate(PUNCT_ASCII)[:1]
        # spaced: not only characters that fold to nothing
        spaced = run.translate(PUNCT_ASCII) != ""
        units.append(TextUnit(" " if spaced and units and is_word(units[-1].canonical)
                              and is_word(after) else "", run, False))
        k = j
    return units


def original_text(units):
    """The original text of text_units' units."""
    return "".join(u.original for u in units)


def solid_indexes(units):
    """The indexes of the solid units of text_units' list."""
    return [k for k, u in enumerate(units) if u.solid]


class EditMerge:
    """The three-way merge of one place: the file's lines there (region, CR kept), the
    lines old_str (or a hunk's old side) has (want) and the lines the edit makes of
    them (new), with the opcodes of want -> new. Lines the edit leaves keep the file's
    bytes; a changed line is merged character by character (what the model did not
    change inside it keeps the file's characters); new lines come in with the file's
    indentation and line ending and the trailing whitespace they were sent with.
    Where the difference has no single right place, lines() raises a refusal."""

    def __init__(self, region, want, new, ops, level, cr="", what="old_str", as_sent=False,
                 file_step=None):
        self.region, self.want, self.new, self.ops, self.level = region, want, new, ops, level
        written = set(j for tag, _, _, j1, j2 in ops if tag != "equal" for j in range(j1, j2))
        # the model's unit as the lines it wrote nest, and the file's
        model_step = indent_step(new, written)
        self.place_unit = (IndentUnit(model_step.columns, file_step.text) if model_step
                           and model_step.columns in (2, 4, 8) and file_step else None)
        # as_sent: an unmapped line at column 0 stays there
        self.cr, self.what, self.as_sent = cr, what, as_sent
        self.plain = [split_cr(l)[0] for l in region]
        self.align = self.aligned()
        pairs = [(want[w], self.plain[r]) for w, r in enumerate(self.align) if r is not None]
        self.mapping = indent_map(*zip(*pairs))
        self.read_indentation(pairs, file_step)
        self.columns = self.aligned_columns(pairs) if level >= BLANK_LEVEL - 1 else {}
        # Typography old_str has where the file's line has none was the copy's slip: the text
        # the model writes takes the file's characters (as it takes the file's indentation).
        self.typography = {ord(c): PUNCT_ASCII[ord(c)] for a, b in pairs
                           for c in set(a) - set(b) if ord(c) in PUNCT_ASCII}
        self.own = set("".join(self.plain))

    def read_indentation(self, pairs, file_step):
        """How old_str's indentation stands for the file's at this place, from the (old_str
        line, file line) `pairs`: `known` (each of old_str's indentations that maps to one of
        the file's), `as_is` (the model wrote the file's own), `indent_chars`, and `off` (the
        indentations that differ)."""
        # the indentations of the pairs that say something of it: both lines have text
        leads = [(leading(a), leading(b)) for a, b in pairs if a.strip() and b.strip()]
        images = {}
        for a, b in leads:
            images.setdefault(a, set()).add(b)
        # Two lines or more with the file's very indentation, one line off at most and the
        # same unit: the model's indentation is the file's, and a new line's is too.
        off = [a for a, b in leads if a != b]
        self.as_is = len(leads) - len(off) >= 2 and len(off) <= 1 and (
            self.place_unit is None
            or self.place_unit.columns == len(self.place_unit.text.expandtabs(4)))
        self.indent_chars = set(file_step.text if file_step
                                else "".join(map(leading, self.plain)))
        # left out: an indentation that maps onto more than one of the file's, and with
        # as_is one that maps onto another (the line that is off is the slip, not a level
        # to follow)
        self.known = {a: bs.pop() for a, bs in images.items()
                      if len(bs) == 1 and (a in bs or not self.as_is)}
        self.off = set(off)

    def aligned(self):
        """For each line of want, the index of the region line it stands for (None: a
        blank line the file does not have there); region lines no want line stands for
        are blank lines old_str lacks."""
        if self.level < BLANK_LEVEL:            # line for line, as level_of compared
            return list(range(len(self.want)))
        anchors = [(-1, -1)] + list(zip([k for k, w in enumerate(self.want) if w.strip()],
                                        [k for k, f in enumerate(self.plain) if f.strip()])) + \
            [(len(self.want), len(self.plain))]
        align = [None] * len(self.want)
        for (w0, r0), (w1, r1) in zip(anchors, anchors[1:]):
            if w1 < len(self.want):
                align[w1] = r1
            ws, rs = range(w0 + 1, w1), range(r0 + 1, r1)
            if w0 < 0:                      # before the first line with text: pair from the end
                ws, rs = ws[::-1], rs[::-1]
            for w, r in zip(ws, rs):
                align[w] = r
        return align

    def refuse(self, why):
        return ToolError(STR_REPLACE_AMBIGUOUS, "%s was found %s, but the edit cannot be placed"
                         " with one right result: %s; nothing was written"
                         % (self.what, MATCH_LEVELS[self.level].name, why))

    def lines(self):
        """The region's lines after the edit (CR kept where the file has it)."""
        out, rp, align = [], 0, self.align
        for tag, i1, i2, j1, j2 in self.ops:
            olds = [w for w in range(i1, i2) if align[w] is not None]
            rows = [align[w] for w in olds]
            if not rows:        # an insert, or only blank lines the file does not have
                next_row = next((r for r in align[i2:] if r is not None), len(self.region))
                if tag == "insert" and rp < next_row:
                    raise self.refuse(
                        "the file has %s at line %d of the match that %s lacks, just where the"
                        " new lines go; copy %s with the file's blank lines"
                        % (plural(next_row - rp, "blank line"), rp + 1, self.what, self.what))
                if tag != "equal":
                    out += map(self.new_line, range(j1, j2))
            else:
                # blank lines old_str lacks, before the block: kept
                out += self.region[rp:rows[0]]
                if tag == "equal":
                    out += self.region[rows[0]:rows[-1] + 1]
                elif tag == "replace":
                    out += self.replaced(rows, olds, j1, j2)
                rp = rows[-1] + 1
        return out + self.region[rp:]

    def replaced(self, rows, olds, j1, j2):
        """The lines new[j1:j2] that replace old_str's lines `olds` (those the file has, at
        the region's `rows`): each made from an old line merged into the file's line, the
        others new lines; a refusal where the file has a blank line among those rows that
        old_str lacks."""
        inside = set(range(rows[0], rows[-1])).difference(rows)
        if inside:
            raise self.refuse("the file has a blank line at line %d of the match, inside"
                              " the lines the edit changes, that %s lacks"
                              % (min(inside) + 1, self.what))
        out = []
        partners = paired_lines([self.want[w] for w in olds], self.new[j1:j2])
        for m, k in enumerate(partners):
            if k is None:
                out.append(self.new_line(j1 + m))
            else:
                row = self.align[olds[k]]
                out.append(self.merged_line(self.want[olds[k]], j1 + m, self.plain[row]) +
                           split_cr(self.region[row])[1])
        return out

    def parent(self, j):
        """The indentation of the line new line j nests under: the nearest line with text
        before it in the new text that is indented less (None at the top)."""
        lead = leading(self.new[j])
        for x in reversed(self.new[:j]):
            if x.strip() and len(leading(x)) < len(lead):
                return leading(x)
        return None

    def under_off(self, j):
        """Whether new line j is placed by whole units under the one line whose indentation
        is off (then its own is not known)."""
        parent = self.parent(j)
        unit = self.place_unit.columns if self.place_unit else 4
        return parent in self.off and (len(leading(self.new[j]).expandtabs(4))
                                       - len(parent.expandtabs(4))) % unit == 0

    def indent(self, j):
        """New line j with the file's indentation (with_indent through the mapping learnt
        from the matched lines); as it is where old_str had the file's own indentation (a
        strict level) or has none to map (whitespace only); a refusal where that mapping is
        not one."""
        line = self.new[j]
        if not line.strip() or self.level < STRICT_LEVELS:
            return line
        mapped = (with_indent(line, self.mapping, self.place_unit)
                  if self.mapping is not None else None)
        if mapped is not None:
            return mapped
        if leading(line) in self.known:
            return self.known[leading(line)] + line.lstrip()
        if (self.as_is and set(leading(line)) <= self.indent_chars and not self.under_off(j)) \
                or (self.as_sent and not leading(line)):
            # a patch's line at column 0 stays there, as Codex writes it
            return line
        raise self.refuse(
            "its indentation maps onto the file's in more than one way, so the indentation of"
            " a new line is not known; copy %s's indentation from the file" % self.what)

    def new_line(self, j):
        """New line j, one the edit adds: the file's indentation and line
        ending, its own text (with the file's column alignment where the match had to
        ignore inner whitespace) and its own trailing whitespace."""
        return self.aligned_line(self.typed(self.indent(j))) + self.cr

    def merged_line(self, w, j, f):
        """The file's line f (old_str's w) changed as w became new line j: indentation the
        model did not change stays the file's, and so do the characters it did not change
        inside the line; its trailing whitespace is the model's, as for a new line."""
        n = self.new[j]
        if not n.strip():
            return f if n == w else n
        lead = leading(f) if leading(n) == leading(w) else leading(self.indent(j))
        wc, nc, fc = w.strip(), n.strip(), f.strip()
        return lead + (fc if nc == wc else self.merged_text(wc, nc, fc)) + trailing(n)

    def typed(self, text):
        """Text the model writes, with the file's characters for the typography its copy
        slipped on; a refusal where its copy has that typography as the file has it too."""
        mixed = set(text) & self.own & set(map(chr, self.typography))
        if mixed:
            raise self.refuse("%s has %s where the file has it and where the file has another"
                              " character, and the new text has it too; write the file's character"
                              % (self.what, min(mixed)))
        return text.translate(self.typography)

    def merged_text(self, wc, nc, fc):
        """fc (the file's text of the line) with the character changes that made nc of wc:
        the characters the model did not change, whitespace included, are the file's."""
        import difflib
        wu, nu, fu = text_units(wc), text_units(nc), text_units(fc)
        ws, fs = solid_indexes(wu), solid_indexes(fu)
        if line_key(wc) != line_key(fc):               # (the solid units' canonical text)
            raise self.refuse("the changed line %r does not line up with the file's %r" % (
                shorten(wc, 60), shorten(fc, 60)))
        twin = dict(zip(ws, fs))                        # w's solid unit -> the file's
        ops = difflib.SequenceMatcher(None, [u.original for u in wu], [u.original for u in nu],
                                      autojunk=False).get_opcodes()
        # the file's text between each two solid units of w that follow one another
        gaps = {(p, q): original_text(fu[twin[p] + 1:twin[q]]) for p, q in zip(ws, ws[1:])}
        spacing = spaced_otherwise(wu, gaps)
        out, same = [], set()                           # same: w's units the model left
        for tag, i1, i2, j1, j2 in ops:
            if tag != "equal":
                out.append(self.put_text(nu[j1:j2], spacing, wc, fc))
                continue
            same.update(range(i1, i2))
            for k in range(i1, i2):
                if wu[k].solid:
                    gap = gaps.get((k - 1, k))          # (only where k - 1 is solid too)
                    if gap and k - 1 in same:
                        # the file's gap where old_str has none: after the text put between
                        # the two, unless it goes with k
                        before_last = k - 1 < i1 and not self.text_continues(
                            out[-1], wu[k - 1].original, wu[k].original)
                        out.insert(len(out) - before_last, gap)
                    out.append(fu[twin[k]].original)
                else:
                    # the file's text between the solid units around this gap; at an end
                    # of the line, the gap as it is
                    out.append(gaps.get(neighbours(ws, k), wu[k].original))
        return "".join(out)

    def put_text(self, units, spacing, wc, fc):
        """The text the model put into a changed line (text_units' `units` of new_str),
        typed; a refusal where it brings punctuation into a line the file spaces otherwise
        than old_str (`spacing`)."""
        put = self.typed(original_text(units))
        # punctuation: neither a word's character (\w is is_word) nor whitespace
        if spacing and re.search(r"[^\w\s]", put):
            raise self.refuse("the file spaces the line %r otherwise than %s (%r), and the change"
                              " puts punctuation into it; copy the line as the file has it"
                              % (shorten(fc, 60), self.what, shorten(wc, 60)))
        return put

    def text_continues(self, put, left, right):
        """Whether text put between two units that the file spaces apart (old_str does not)
        continues the unit on its left (the gap then goes after it), not the one on its right
        (the gap goes before it); a refusal when that cannot be told (both, or neither)."""
        joins_left = is_word(put[:1]) and is_word(left[-1:])
        joins_right = is_word(put[-1:]) and is_word(right[:1])
        if joins_left == joins_right:
            raise self.refuse("the file has whitespace between %r and %r where %s has none, and"
                              " the change puts %r there; copy the line as the file has it"
                              % (left, right, self.what, shorten(put, 40)))
        return joins_left

    @staticmethod
    def aligned_columns(pairs):
        """{token: column} where the file pads whitespace that old_str squeezed to line up
        a token (=, =>, :) in one column, on two lines at least and on every such line."""
        cols = {}
        for w, f in pairs:
            lead, fc, wc = leading(f), f.strip(), w.strip()
            if squeezed(wc) != squeezed(fc):
                continue
            wu, fu = text_units(wc), text_units(fc)
            ws, fs = solid_indexes(wu), solid_indexes(fu)
            for (p, q), (fp, fq) in zip(zip(ws, ws[1:]), zip(fs, fs[1:])):
                file_gap, old_gap = original_text(fu[fp + 1:fq]), original_text(wu[p + 1:q])
                if len(file_gap) > max(1, len(old_gap)) and file_gap.isspace():
                    token = original_text(fu[fq:]).split()[0]
                    cols.setdefault(token, []).append(len(lead) + len(original_text(fu[:fq])))
        return {t: c[0] for t, c in cols.items() if len(set(c)) == 1 < len(c)}

    def aligned_line(self, line):
        """A new line whose tokens that the file aligns in a column stand in that column
        (padded; never cut)."""
        if not self.columns:
            return line
        lead = leading(line)
        parts = re.split(r"(\s+)", line[len(lead):])
        out = lead + parts[0]
        for k in range(1, len(parts) - 1, 2):
            gap, word = parts[k], parts[k + 1]
            col = self.columns.get(word)
            if col is not None and len(out) + len(gap) < col:
                gap = " " * (col - len(out))
            out += gap + word
        return out


def neighbours(ws, k):
    """(the last of the sorted indexes ws below k, the first above it); None where there is none."""
    lo, hi = bisect_left(ws, k), bisect_right(ws, k)
    return ws[lo - 1] if lo else None, ws[hi] if hi < len(ws) else None


def spaced_otherwise(wu, gaps):
    """Whether the file spaces a line otherwise than old_str does: between two of old_str's
    solid units (`gaps`: {(p, q): the file's text between them}, indexes into its units wu)
    the file has whitespace where old_str has none, or none where old_str has some."""
    return any(not gap.strip() and bool(gap) != any(not wu[k].solid for k in range(p + 1, q))
               for (p, q), gap in gaps.items())


def split_after(line, head):
    """(the start of the file's `line` that stands for `head`, the rest of it): `head` is
    the start of the line as the matcher sees it (CR kept on the rest)."""
    line, cr = split_cr(line)
    lead = leading(line)
    units = text_units(line[len(lead):])
    last = solid_indexes(units)[len(solid_indexes(text_units(head.strip()))) - 1]
    cut = len(lead) + sum(len(u.original) for u in units[:last + 1])
    return line[:cut], line[cut:] + cr


def relaxed_note(level, merge):
    """How a relaxed match was made, for the result: the level, and for a match made
    ignoring indentation how the file indents."""
    name = MATCH_LEVELS[level].name
    leads = "".join((merge.mapping or {}).values())        # the file's indentations there
    if not MATCH_LEVELS[level].maps_indent or not leads:
        return name
    return name + ", " + ("the file indents with tabs" if "\t" in leads else
                          "the file's indentation differs from old_str's")


# -- the one edit writer -----------------------------------------------------------
# An edit loads the file as it was seen, and writes through write_edit: one diff, one
# undo record, one atomic write per file, or nothing at all.

def require_viewed(session, ctx, real, shown):
    """FILE_NOT_VIEWED when view-before-edit is on and this session has not viewed `real`."""
    if ctx.config.require_view_before_edit and not session.has_viewed(real):
        raise ToolError(FILE_NOT_VIEWED, "%s has not been viewed in this session; view it first"
                        " (view-before-edit is on), then retry the edit" % shown)


def load_for_edit(session, ctx, real, shown):
    """The text of an existing regular file that may be edited now (call it under
    ctx.files.lock(real)): bytes decoded with surrogateescape, so any byte round-trips."""
    try:
        fd, st = open_regular(real, shown, "edited")
    except ToolError as e:
        if e.detail == "directory":
            raise ToolError(INVALID_INPUT, "%s is a directory; edits apply to files" % shown)
        raise
    try:
        require_viewed(session, ctx, real, shown)
        limit = ctx.config.max_file_size
        if st.st_size > limit:
            raise too_large(shown, st.st_size, limit)
        data = read_fd(fd, limit, shown)
    except OSError as e:
        raise io_error(e, shown)
    finally:
        os.close(fd)
    return data.decode("utf-8", "surrogateescape")


def edit_text(session, args, ctx, tool, change):
    """The text edits' one path: under the file's lock, its text (load_for_edit) made over by
    change(text) -> (updated text, facts...) and written as `tool` (dry_run: the diff).
    Returns (real, change's, note). (The text always encodes: the file's undecodable bytes
    come back through surrogateescape, and no argument holds a lone surrogate.)"""
    shown = args["path"]
    real = resolve_checked(session, ctx, shown)
    with ctx.files.lock(real):
        text = load_for_edit(session, ctx, real, shown)
        made = change(text)
        note = write_edit(session, ctx, tool, [FileEdit(real, shown, encode_text(made[0]),
                                                        encode_text(text))], args.get("dry_run"))
    return real, made, note


def to_crlf(s):
    """`s` with every line ending CRLF."""
    return s.replace("\r\n", "\n").replace("\n", "\r\n")


def encode_text(text, name="content"):
    """The bytes to write for `text` (UTF-8; lone surrogates from undecodable bytes turned back
    into those bytes); INVALID_INPUT naming `name` for text that cannot be written."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise ToolError(INVALID_INPUT, "%s holds an unpaired surrogate character; send valid"
                        " UTF-8 text" % name)


UNKNOWN = object()      # an edit's 'before' that the writer reads itself
DRY_RUN_PROP = prop("boolean", "Only show the diff it would write.")

# One file of an edit, as write_edit takes it: `data` the bytes to write (None: remove the
# file), `before` what is there now (bytes, None for no file, UNKNOWN: write_edit reads it),
# `mode` the permission bits of a file the edit makes (None: 0o644).
FileEdit = namedtuple("FileEdit", "real shown data before mode", defaults=(UNKNOWN, None))
# What a file held before an edit: its bytes and permission bits (both None: no file).
Before = namedtuple("Before", "data mode")
# One file of an edit undo_edit can take back: the bytes before (None: no file; StoredBytes:
# in the checkpoint store), their mode, and the digest written (None: removed).
UndoEntry = namedtuple("UndoEntry", "before mode after")


def write_edit(session, ctx, tool, changes, dry_run=False):
    """Write one edit ([FileEdit]) through the one writer, all of it or none. In one
    place: the size limit (FILE_TOO_LARGE, nothing written), the atomic writes (a failure
    puts back the files written before it), the viewed mark, the undo level (none for a
    file over the limit, none for undo_edit itself) and the parse warning. Returns the
    note for the answer (where a file had to be rewritten in place, what no longer
    parses); with dry_run, the unified diff it would write instead, and nothing is
    written or kept."""
    limit = ctx.config.max_file_size
    for change in changes:
        if change.data is not None and len(change.data) > limit:
            raise ToolError(FILE_TOO_LARGE, "the new content of %s is %s; the limit is %s"
                            " (--max-file-size); nothing was written"
                            % (change.shown, human_size(len(change.data)), human_size(limit)))
    known = files_before(changes, limit)
    todo = [c._replace(before=known[c.real].data if known[c.real] else None) for c in changes]
    if dry_run:
        return edit_diff(todo, ctx.config.max_result_chars)
    note = write_files(session, ctx, todo, known)
    # files over the limit (known None) get no undo level and no parse check
    undoable = [c for c in todo if known[c.real] is not None]
    undo = {c.real: UndoEntry(c.before, known[c.real].mode,
                              digest_of(c.data) if c.data is not None else None)
            for c in undoable}
    if undo and tool != "undo_edit":
        session.remember_edit(tool, keep_for_undo(session, undo))
    return note + "".join(parse_warning(c.real, c.before, c.data)
                          for c in undoable if c.data is not None) + (
        ctx.lsp.verdicts(todo) if ctx.lsp else "")


def write_files(session, ctx, todo, known):
    """Write an edit's files ([FileEdit], removals last), each marked viewed as written;
    the notes of files rewritten in place. A failure puts back the files written before
    it, and says so in an IO_ERROR."""
    done, notes = [], []
    try:
        for change in sorted(todo, key=lambda c: c.data is None):
            top = directories_made(change.real)     # (None for a file that was there)
            if change.data is None:
                remove_file(change.real)
            elif not atomic_write(change.real, change.data, ctx.files, change.mode or 0o644):
                notes.append(" (%s rewritten in place: its directory refuses new files or"
                             " renames)" % change.shown)
            done.append((change, top))
            if change.data is not None:
                session.mark_viewed(change.real,
                                    Seen(os.stat(change.real), digest_of(change.data)))
    except (OSError, ToolError) as e:
        why = e.message if isinstance(e, ToolError) else (e.strerror or str(e))
        raise ToolError(IO_ERROR, "writing %s failed (%s); %s"
                        % (change.shown, why, roll_back(done, known, ctx)))
    return "".join(notes)


def directories_made(real):
    """The topmost directory that writing a file at `real` makes (None: its directory is
    there)."""
    top, d = None, os.path.dirname(real)
    while not os.path.lexists(d):
        top, d = d, os.path.dirname(d)
    return top


def files_before(changes, limit):
    """What is there before an edit's changes, by real path: a Before (both None for no
    file), or None for a file over the limit or not a regular file (it gets no undo
    level); an IO_ERROR naming the file when one cannot be read."""
    known = {}
    for change in changes:
        try:
            known[change.real] = file_bytes(change.real, limit) if change.before is UNKNOWN \
                else Before(change.before, None if change.before is None
                            else stat.S_IMODE(os.stat(change.real).st_mode))
        except ToolError:
            known[change.real] = None
        except OSError as e:
            raise io_error(e, change.shown)
    return known


StoredBytes = namedtuple("StoredBytes", "digest size")
StoredBytes.__doc__ = ("A file's bytes before an edit, kept in the session's checkpoint store"
                       " under `digest`.")


def keep_for_undo(session, undo):
    """An edit's {real: UndoEntry} for the undo history, each file's bytes before put in the
    session's checkpoint store (one store for checkpoints and undo_edit) where it has one
    with room; held in memory where not (checkpoints off, the budget spent)."""
    checkpoints = session.checkpoints
    if checkpoints is None or not checkpoints.open_store():
        return undo
    kept = {}
    for real, entry in undo.items():
        if entry.before:
            digest, _ = checkpoints.put(entry.before)
            if digest is not None:
                entry = entry._replace(before=StoredBytes(digest, len(entry.before)))
        kept[real] = entry
    return kept


def bytes_before(session, before):
    """The bytes an undo history entry holds (keep_for_undo), read back from the store if
    kept there."""
    if not isinstance(before, StoredBytes):
        return before
    try:
        return session.checkpoints.blob(before.digest)
    except OSError as e:
        raise ToolError(IO_ERROR, "the bytes to restore are gone from the checkpoint store (%s);"
                        " nothing was undone" % (e.strerror or e))


def roll_back(done, known, ctx):
    """Undo the writes `done` [(FileEdit, top directory made)] of an edit that failed
    half-way, in reverse; a sentence saying how that went."""
    failed = []
    for change, top in reversed(done):
        try:
            if change.before is None:
                remove_file(change.real)
                for d, _, _ in sorted(os.walk(top) if top else (), reverse=True):
                    os.rmdir(d)                             # the empty directories the write made
            else:
                atomic_write(change.real, change.before, ctx.files,
                             known[change.real].mode or 0o644)
        except OSError:
            failed.append(change.real)
    if failed:
        return "the files written before it could not all be restored: %s" % ", ".join(failed)
    return "the %s written before it were restored, so nothing changed" % plural(len(done), "file")


def unified_diff(before, after, shown):
    """The unified diff of bytes `before` -> `after` (None: no file there) as git writes it,
    the file named `shown`: a line without its newline says so."""
    import difflib
    a = (before or b"").decode("utf-8", "surrogateescape").splitlines(True)
    b = (after or b"").decode("utf-8", "surrogateescape").splitlines(True)
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                   for line in difflib.unified_diff(
                       a, b, "/dev/null" if before is None else "a/" + shown,
                       "/dev/null" if after is None else "b/" + shown))


def edit_diff(todo, cap):
    """The answer of a dry run: the unified diff of each file's change, with the file's
    line numbers, cut to fit `cap`."""
    text = "".join(unified_diff(c.before, c.data, c.shown) for c in todo)
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if not text:
        return "Dry run: the edit would change nothing; nothing was written."
    head = ("Dry run: nothing was written. The edit would make this change (unified diff, the"
            " file's line numbers):\n")
    if len(head) + len(text) > cap - 200:
        text = text[:cap - 400] + "\n[diff cut at %d of %d characters]" % (cap - 400, len(text))
    return head + text


def file_bytes(real, limit):
    """The Before of the regular file at `real`: its bytes and permission bits (the one
    opener: a FIFO or device put there is refused, never read), both None when nothing is
    there."""
    try:
        os.lstat(real)
    except (FileNotFoundError, NotADirectoryError):
        return Before(None, None)
    data, st = read_regular(real, real, limit)
    return Before(data, stat.S_IMODE(st.st_mode))


def parse_warning(real, before, after):
    """One line when an edit left a .py, .json, .toml (3.11+) or .ipynb file that
    parsed before no longer parsing: the error, its line and that undo_edit takes it
    back; '' otherwise (also for a file that did not parse before, or over
    PARSE_CHECK_BYTES). Parsing only: nothing runs, nothing is imported."""
    ext = os.path.splitext(real)[1].lower()
    if before is None or ext not in (".py", ".json", ".toml", ".ipynb") or \
            max(len(before), len(after)) > PARSE_CHECK_BYTES:
        return ""
    error = parse_error(ext, after) if parse_error(ext, before) is None else None
    if error is None:
        return ""
    return ("\n[warning: %s no longer parses as %s: %s; undo_edit takes the edit back]"
            % (os.path.basename(real), ext[1:].upper() if ext != ".py" else "Python", error))


def parse_error(ext, data):
    """Why `data` does not parse as a file of type `ext`, or None when it does (or
    cannot be checked here: TOML before Python 3.11)."""
    import ast
    import warnings
    try:
        text = data.decode("utf-8-sig")
        if ext == ".py":
            # a '\ ' in a string is the file's business, not a parse error
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ast.parse(text)
        elif ext == ".toml":
            try:
                import tomllib
            except ImportError:
                return None  # no TOML parser before 3.11: not checked
            tomllib.loads(text)
        else:
            json.loads(text)
    except SyntaxError as e:
        return "%s at line %s" % (e.msg, e.lineno)
    except ValueError as e:                 # json's and tomllib's errors (and undecodable bytes)
        return str(e)
    except (RecursionError, MemoryError):
        return None  # too deep to check: no warning rather than a guess
    return None


def check_unchanged(session, ctx, real, shown):
    """FILE_CHANGED when `real` no longer holds what this session last saw there."""
    seen = session.seen_of(real)
    if seen is None:
        return
    change = changed_since(seen, real, ctx.config.max_file_size)
    if change:
        raise ToolError(FILE_CHANGED, "%s changed since this session last saw it (%s); view it"
                        " again before overwriting it, so that no one else's change is lost"
                        % (shown, change))


def snippet(text, first_line, span):
    """The numbered lines around an edit (SNIPPET_CONTEXT either side), as its answer shows them
    (CRLF shown as LF)."""
    lines = text.replace("\r\n", "\n").split("\n")
    lo = max(0, first_line - SNIPPET_CONTEXT)
    hi = min(len(lines), first_line + span + SNIPPET_CONTEXT + 1)
    return number_lines([clip_line(l) for l in lines[lo:hi]], lo + 1)


def newline_at(text, pos):
    """The line ending of the line holding offset `pos` ('\\n' at the end of the text)."""
    j = text.find("\n", pos)
    return "\r\n" if j > 0 and text[j - 1] == "\r" else "\n"


def match_lines(text, old, most=20):
    """'3, 17, 40' - the line where each occurrence of `old` starts, overlapping ones too
    (the first `most` lines)."""
    lines, pos, line, at = [], 0, 1, 0
    while len(lines) < most:
        i = text.find(old, pos)
        if i < 0:
            return ", ".join(lines)
        line += text.count("\n", at, i)
        at = i
        lines.append(str(line))
        # the next line: one occurring later on this one has its number
        pos = text.find("\n", i) + 1
        if not pos:
            return ", ".join(lines)
    return ", ".join(lines) + ", ..."


def closest_region(text, old, cancelled=NOT_CANCELLED, what="old_str"):
    """A note on where `old` nearly is: the most similar run of lines with its line
    numbers and a short diff (or a word on line-number prefixes and whitespace).

    The work is bounded whatever the sizes, and a cancel ends it with no note:
    candidate places come from file lines equal to a line of old_str but for the
    whitespace around it (one dict lookup a line), or, when there are none, from the
    lines closest to old_str's first line (at most MISS_SCAN_LINES, each cut to 200
    characters); at most MISS_CANDIDATES places of at most MISS_WINDOW_LINES lines
    are scored, line by line, in time linear in their length."""
    lines = text_lines(text, ended=False)
    want = text_lines(old)
    numbered = re.compile(r"^ *\d+\t")
    if numbered.match(want[0]) and all(numbered.match(w) for w in want if w):
        return (" old_str starts its lines with view's line-number prefixes (number, tab);"
                " leave them out.")
    want = want[:MISS_WINDOW_LINES]
    import difflib
    n = len(want)
    best, at = 0.0, None
    for start in candidate_starts(lines, want, cancelled):
        if cancelled.is_set():
            return ""
        s = max(0, min(start, len(lines) - n))
        total = 0.0                 # line by line: equal but for surrounding whitespace counts 0.95
        for a, b in zip(lines[s:s + n], want):
            if a == b:
                total += 1.0
            elif a.strip() == b.strip():
                total += 0.95
            else:
                total += difflib.SequenceMatcher(None, a[:200], b[:200],
                                                 autojunk=False).quick_ratio()
        if total / n > best:
            best, at = total / n, s
    if best < 0.5:                              # (also when no place was scored)
        return ""
    return region_report(lines[at:at + n], want, at, best, what)


def region_report(region, want, at, best, what):
    """The closest region (starting at line index `at`) in full, so that it can be copied,
    what differs in whitespace line by line, and a diff numbered with the file's lines."""
    import difflib

    def indents(s):
        if "\t" in s:
            return plural(s.count("\t"), "tab")
        return plural(len(s), "space") if s else "no indentation"
    ws = []                             # lines equal but for whitespace: what differs, in words
    for k, (f, w) in enumerate(zip(region, want)):
        if f == w or f.strip() != w.strip():
            continue
        says = []                       # (one of the two below at least: the lines differ)
        if leading(f) != leading(w):
            says.append("the file indents with %s, %s with %s"
                        % (indents(leading(f)), what, indents(leading(w))))
        if trailing(f) != trailing(w):
            says.append("the file has %s, %s %d"
                        % (plural(len(trailing(f)), "trailing space"), what, len(trailing(w))))
        ws.append("line %d: %s" % (at + k + 1, "; ".join(says)))
    hint = ""
    if list(map(str.strip, region)) == list(map(str.strip, want)):
        hint = (" They differ only in indentation or trailing spaces: copy the whitespace from"
                " the lines below.")
    shown = number_lines([clip_line(l)[:200] for l in region[:MISS_CONTEXT_LINES]], at + 1)
    diff = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, region, want,
                                                       autojunk=False).get_opcodes():
        if tag != "equal":
            diff += ["-%6d\t%s" % (at + i + 1, visible(region[i])[:200]) for i in range(i1, i2)]
            diff += ["+%6s\t%s" % ("", visible(want[j])[:200]) for j in range(j1, j2)]
    return ("\nThe closest text is at lines %d-%d (%d%% similar):%s\n%s%s\nHow %s differs"
            " (- file line, + %s; a trailing space shows as \u00b7, a tab as \u2192):\n%s"
            % (at + 1, at + len(region), int(best * 100), hint, shown,
               ("\n" + "\n".join(ws[:MISS_CONTEXT_LINES])) if ws else "", what, what,
               "\n".join(diff[:2 * MISS_CONTEXT_LINES])))


def visible(line):
    """A line of a miss's diff with its trailing spaces and its tabs made visible."""
    body = line.rstrip(" ")
    return body.replace("\t", "\u2192") + "\u00b7" * (len(line) - len(body))


def candidate_starts(lines, want, cancelled):
    """Up to MISS_CANDIDATES line indexes where `want` may start in `lines`, most
    likely first (see closest_region)."""
    keys = {}
    for k, w in enumerate(want):
        if w.strip():
            keys.setdefault(w.strip(), k)
    votes = Counter()
    for i, line in enumerate(lines):
        k = keys.get(line.strip())
        if k is not None:
            votes[i - k] += 1
    if votes:
        return [start for start, _ in votes.most_common(MISS_CANDIDATES)]
    # Not a single line in common: the places whose line is closest (ratio >= 0.6, the
    # quick upper bounds first) to want's first non-blank line, among the first
    # MISS_SCAN_LINES lines, each cut to 200 characters.
    if not keys:
        return []
    import difflib
    first = min(keys.values())
    matcher = difflib.SequenceMatcher(autojunk=False)
    matcher.set_seq2(want[first].strip()[:200])
    close = []
    for i, line in enumerate(lines[:MISS_SCAN_LINES]):
        if i % 1000 == 0 and cancelled.is_set():
            return []
        matcher.set_seq1(line.strip()[:200])
        if matcher.real_quick_ratio() >= 0.6 and matcher.quick_ratio() >= 0.6:
            ratio = matcher.ratio()
            if ratio >= 0.6:
                close.append((ratio, -i))              # (-i: the first of equal ones wins)
    return [-neg_i - first for _, neg_i in heapq.nlargest(MISS_CANDIDATES, close)]


def check_old_new(old, new):
    """An edit's old_str and new_str as every edit tool takes them, or INVALID_INPUT."""
    if old == "":
        raise ToolError(INVALID_INPUT, "old_str is empty; give the exact text to replace"
                        " (to write a whole file use create_file)")
    if old == new:
        raise ToolError(INVALID_INPUT,
                        "old_str and new_str are identical; there is nothing to change")


# -- the edit tools ----------------------------------------------------------------

def replace_text(text, edit, shown, cancelled):
    """(updated text, count, offset of the first change, how it matched or '') of an
    edit ({old_str, new_str, replace_all}, as str_replace and each of multi_edit's take
    it) through the one matcher. Refused: old_str empty or equal to new_str, not found
    (with the closest region), or more than one place at the level that matched."""
    old, new = edit["old_str"], edit.get("new_str") or ""
    replace_all = edit.get("replace_all")
    check_old_new(old, new)
    count = text.count(old)
    how = ""
    if count == 0 and "\r\n" not in old and "\r\n" in text:
        # (an old_str without LF stays as it is, and not found)
        old, how = to_crlf(old), "with CRLF line endings"
        count = text.count(old)
    if count and new[:1] in " \t" and old[:1] not in " \t\n" and at_line_text(text, old):
        # old_str lost its first line's indentation, new_str has it: give it back
        pos = text.find(old)
        whole = text[text.rfind("\n", 0, pos) + 1:pos] + old
        if text.count(whole) != count:
            count = 0                           # another place is indented otherwise
        old = whole
    if count and not replace_all and text.find(old, text.find(old) + 1) >= 0:
        # a second place, also one overlapping the first ('x\nx' in 'x\nx\nx')
        raise ToolError(STR_REPLACE_AMBIGUOUS, "old_str occurs %d times in %s (at lines %s) and"
                        " must be unique; add surrounding lines to old_str to pick one, or set"
                        " replace_all to true"
                        % (max(count, 2), shown, match_lines(text, old)))
    if count:
        return replaced(text, old, new), count, text.find(old), how
    return replace_lines(text, edit, shown, cancelled)


def replace_lines(text, edit, shown, cancelled=NOT_CANCELLED):
    """replace_text's relaxed levels: old_str as whole lines found by find_lines, the
    difference old_str -> new_str merged into the file's lines there (EditMerge); the
    same answer as replace_text."""
    import difflib
    old, new = edit["old_str"], edit.get("new_str") or ""
    lines = text.split("\n")
    plain = text_lines(text, ended=False)           # the lines without CR
    want = text_lines(old)
    level, hits, partial = relaxed_places(LineIndex(plain), want, text, edit, shown, cancelled)
    new_lines = text_lines(new, ended=old.endswith("\n")) if new else []
    ops = difflib.SequenceMatcher(None, want, new_lines, autojunk=False).get_opcodes()
    hits = non_overlapping(hits)                # replace_all: no two places overlap
    merge = None
    for i, j in reversed(hits):
        region, rest = lines[i:j], ""
        # the file's line goes on after old_str: that stays after new_str
        if partial:
            region[-1], rest = split_after(region[-1], want[-1])
        merge = EditMerge(region, want, new_lines, ops, level, "\r" if "\r\n" in text else "",
                          file_step=indent_step(plain))
        put = merge.lines()
        if rest:
            if not put:
                raise merge.refuse("old_str ends inside line %d, and the edit removes everything"
                                   " before the rest of that line" % j)
            body, cr = split_cr(put[-1])
            put[-1] = body + rest + cr
        if j == len(lines) and not lines[-1].endswith("\r"):
            # (a last line: no CR)
            put[-1:] = [split_cr(line)[0] for line in put[-1:]]
        lines[i:j] = put
    # where the first change starts: each line before it, and its "\n"
    offset = sum(len(line) + 1 for line in lines[:hits[0][0]])
    return "\n".join(lines), len(hits), offset, relaxed_note(level, merge)


def relaxed_places(index, want, text, edit, shown, cancelled):
    """(level, places, partial) of an edit's old_str lines `want` in the file (a
    LineIndex): found by find_lines as whole lines or, where nowhere, with its last line
    ending inside the file's (partial), as an exact match may. Refused: not found (with
    the closest region), or more than one place without replace_all."""
    old = edit["old_str"]
    level, hits, elsewhere = find_lines(index, want)
    partial = not hits and not old.endswith("\n")
    if partial:
        level, hits, elsewhere = find_lines(index, want, partial=True)
    if not hits:
        raise ToolError(STR_REPLACE_NOT_FOUND, "old_str was not found in %s; view the file and"
                        " copy the text exactly, whitespace and indentation included.%s"
                        % (shown, closest_region(text, old, cancelled)))
    if len(hits) + len(elsewhere) > 1 and not edit.get("replace_all"):
        places = sorted(hits + elsewhere)
        raise ToolError(STR_REPLACE_AMBIGUOUS, "old_str matches %d places in %s %s (at lines %s),"
                        " and a relaxed match must be unique; copy old_str exactly from the file,"
                        " or add surrounding lines"
                        % (len(places), shown, MATCH_LEVELS[level].name,
                           ", ".join(str(i + 1) for i, _ in places[:20])))
    return level, hits, partial


def non_overlapping(spans):
    """The (start, end) spans, in order, each left out that overlaps the one kept before it."""
    kept = []
    for span in spans:
        if not kept or span[0] >= kept[-1][1]:
            kept.append(span)
    return kept


def at_line_text(text, old):
    """Whether every place `old` stands begins a line's text after its indentation."""
    pos = text.find(old)
    while pos >= 0:
        start = text.rfind("\n", 0, pos) + 1
        if pos == start or text[start:pos].strip():
            return False
        pos = text.find(old, pos + 1)
    return True


def replaced(text, old, new):
    """text with every `old` replaced by `new` in the line ending of where it goes."""
    bare = new.replace("\r\n", "\n")
    parts, pos = [], 0
    while True:
        i = text.find(old, pos)
        if i < 0:
            break
        nl = "\r\n" if "\r\n" in old else ("\n" if "\n" in old else newline_at(text, i))
        parts += [text[pos:i], bare if nl == "\n" else to_crlf(bare)]
        pos = i + len(old)
    parts.append(text[pos:])
    return "".join(parts)


STR_REPLACE_DESC = ("Edit a file - the edit tool for most edits: replace text (old_str with "
                    "new_str) to modify code in place. Copy old_str from the file (without view's "
                    "line-number prefix); it must occur once, unless replace_all is true. Slips - "
                    "indentation, tabs, spaces, blank lines, CRLF, typographic quotes - are "
                    "forgiven where only one place fits: what new_str changes is written in the "
                    "file's own style. View the file first.")


@tool("str_replace", STR_REPLACE_DESC, obj({
    "path": PATH_PROP,
    "old_str": prop("string", "The exact text to replace."),
    "new_str": prop("string", "The replacement text (default empty: delete old_str)."),
    "replace_all": prop("boolean", "Replace every occurrence instead of requiring one."),
    "dry_run": DRY_RUN_PROP,
}, ["path", "old_str"]), notes("Replace text in a file", destructive=True), modes=DEFAULT,
      hint="edit code in a file")
def tool_str_replace(session, args, ctx):
    """str_replace: replace old_str (unique, or every one with replace_all) in a file viewed and
    unchanged since."""
    real, (updated, count, pos, how), note = edit_text(
        session, args, ctx, "str_replace",
        lambda text: replace_text(text, args, args["path"], ctx.cancelled))
    if args.get("dry_run"):
        return note + ("\n(old_str matched %s)" % how if how else "")
    added = (args.get("new_str") or "").count("\n")
    around = snippet(updated, updated.count("\n", 0, pos), added)
    return "Replaced %s in %s%s:\n%s%s" % (plural(count, "occurrence"), real,
                                         " (matched %s)" % how if how else "", around, note)


MULTI_EDIT_DESC = ("Make several changes to one file in one call: each {old_str, new_str, "
                   "replace_all?} works as str_replace does and applies to the result of the one "
                   "before it. All land or none does. View the file first.")


@tool("multi_edit", MULTI_EDIT_DESC, obj({
    "path": PATH_PROP,
    "edits": prop("array", "The edits, in order.", minItems=1,
                  items=obj({
                      "old_str": prop("string",
                                      "The exact text to replace (unique unless replace_all)."),
                      "new_str": prop("string",
                                      "The replacement text (default empty: delete old_str)."),
                      "replace_all": prop("boolean", "Replace every occurrence."),
                  }, ["old_str"])),
    "dry_run": DRY_RUN_PROP,
}, ["path", "edits"]), notes("Edit a file in several places", destructive=True),
      hint="several edits, one file")
def tool_multi_edit(session, args, ctx):
    """Several str_replace edits of one file: each applies to the result of the one
    before; all of them or none are written, in one atomic write."""
    shown, edits, matched = args["path"], args["edits"], []

    def change(text):
        replaced, pos = 0, 0
        for k, edit in enumerate(edits, 1):
            try:
                text, count, pos, how = replace_text(text, edit, shown, ctx.cancelled)
                if how:
                    matched.append("edit %d matched %s" % (k, how))
            except ToolError as e:
                raise ToolError(e.code, "edit %d of %d: %s\nNothing was written (the edits apply"
                                " all or none)" % (k, len(edits), e.message.rstrip(".")))
            replaced += count
        return text, replaced, pos
    real, (text, replaced, pos), note = edit_text(session, args, ctx, "multi_edit", change)
    if args.get("dry_run"):
        return note + ("\n(%s)" % "; ".join(matched) if matched else "")
    line = text.count("\n", 0, pos)
    added = (edits[-1].get("new_str") or "").count("\n")
    return "Applied %s (%s) to %s%s; around the last one:\n%s" % (
        plural(len(edits), "edit"), plural(replaced, "replacement"), real,
        " (%s)" % "; ".join(matched) if matched else "",
        snippet(text, line, added)) + note


def existing_kind(real, shown):
    """None when nothing is at `real`, else its lstat; a directory or special file is refused."""
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return None  # nothing there: a new file
    except OSError as e:
        raise io_error(e, shown)
    if stat.S_ISDIR(st.st_mode):
        raise ToolError(INVALID_INPUT, "%s is a directory; give a file path" % shown)
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(shown, st.st_mode, "overwritten")
    return st


CREATE_DESC = ("Create a new file, or write a whole file: the given content, overwriting an "
               "existing one (view it first). Missing parent directories are created. Prefer "
               "str_replace for changing part of an existing file.")


@tool("create_file", CREATE_DESC, obj({
    "path": PATH_PROP,
    "content": prop("string", "The complete file content."),
    "dry_run": DRY_RUN_PROP,
}, ["path", "content"]), notes("Create or overwrite a file", destructive=True), modes=DEFAULT,
      hint="write a new file")
def tool_create_file(session, args, ctx, content_key="content"):
    """create_file: write a whole file (made or overwritten), its directories made as needed."""
    shown = args["path"]
    real = resolve_checked(session, ctx, shown)
    data = encode_text(args[content_key], content_key)
    with ctx.files.lock(real):
        existed = existing_kind(real, shown) is not None
        if existed:
            require_viewed(session, ctx, real, shown)
            check_unchanged(session, ctx, real, shown)
        note = write_edit(session, ctx, "create_file", [FileEdit(real, shown, data)],
                          args.get("dry_run"))
    if args.get("dry_run"):
        return note
    return "%s %s (%d bytes)%s" % ("Overwrote" if existed else "Created", real, len(data), note)


def inserted(text, at, text_in):
    """(text with text_in's lines after line `at`, in the file's line ending; those
    lines), or INVALID_INPUT when `at` is outside the file."""
    nl = "\r\n" if "\r\n" in text else "\n"
    lines = text.split(nl)
    trailing = text.endswith(nl)
    total = len(lines) - 1 if trailing else (0 if text == "" else len(lines))
    if not 0 <= at <= total:
        raise ToolError(INVALID_INPUT, "insert_line %d is outside the file; give 0 (the top) to"
                        " %d (after the last line)" % (at, total))
    body = lines[:total]
    new_lines = (to_crlf(text_in) if nl == "\r\n" else text_in).split(nl)
    if text_in.endswith("\n"):
        new_lines = new_lines[:-1]
    body[at:at] = new_lines
    return nl.join(body) + (nl if trailing or at == total else ""), new_lines


def tool_insert(session, args, ctx):
    """insert: add lines after line insert_line (0: at the top) of a file."""
    text_in = args.get("insert_text", args.get("new_str"))
    if text_in is None or args.get("insert_line") is None:
        raise ToolError(INVALID_INPUT, "insert needs insert_line and insert_text (or new_str)")
    at = args["insert_line"]
    real, (updated, new_lines), note = edit_text(session, args, ctx, "insert",
                                                 lambda text: inserted(text, at, text_in))
    if args.get("dry_run"):
        return note
    return "Inserted %s after line %d of %s:\n%s" % (
        plural(len(new_lines), "line"), at, real,
        snippet(updated, at, len(new_lines) - 1)) + note


UNDO_DESC = ("Undo: take back this session's last change to a path, made by any tool that writes "
             "files (a deleted file comes back, an added one goes, a move moves back), restoring "
             "it byte for byte. Repeat it to go further back (up to %d changes a file). Refused, "
             "changing nothing, when something else changed the file since." % UNDO_LEVELS)


@tool("undo_edit", UNDO_DESC, obj({"path": PATH_PROP, "dry_run": DRY_RUN_PROP}, ["path"]),
      notes("Undo the last edit of a file", destructive=True), modes=DEFAULT, hint="undo an edit")
def tool_undo_edit(session, args, ctx):
    """undo_edit: restore a file (and the others an apply_patch changed with it) as
    it was before this session's last edit of it, if nothing else changed it since."""
    shown = args["path"]
    real = resolve_checked(session, ctx, shown)
    edit, levels = session.last_edit(real)
    if edit is None:
        raise ToolError(INVALID_INPUT, "nothing to undo for %s: this session has no edit of it"
                        " left to take back (at most %d a file are kept)" % (shown, UNDO_LEVELS))
    tool_name, changes = edit
    for path in changes:
        ctx.policy.check(path, path)
    with contextlib.ExitStack() as locks:
        for path in sorted(changes):
            locks.enter_context(ctx.files.lock(path))
        back = []
        for path, entry in sorted(changes.items()):
            now = file_bytes(path, ctx.config.max_file_size).data
            if (None if now is None else digest_of(now)) != entry.after:
                raise ToolError(FILE_CHANGED, "%s changed since this session's %s of it (by"
                                " something else), so undo_edit would lose that; nothing was"
                                " undone. View it and edit it instead" % (path, tool_name))
            back.append(FileEdit(path, path, bytes_before(session, entry.before), now, entry.mode))
        note = write_edit(session, ctx, "undo_edit", back, args.get("dry_run"))
        if args.get("dry_run"):
            return note
        session.forget_edit(edit)
    what = ", ".join("%s (%s)" % (c.real, "removed" if c.data is None else
                                  "%d bytes" % len(c.data)) for c in back)
    left = "%s for %s." % (plural(levels - 1, "more undo level"), shown) if levels > 1 else \
        "Nothing more to undo for %s." % shown
    return "Undid the %s: restored %s. %s%s" % (tool_name, what, left, note)


# -- rewind ---------------------------------------------------------------------------

CHECKPOINTS_DESC = ("List this session's checkpoints of the workspace: one is taken before every "
                    "call that can change files, bash and its tasks included. Each shows its "
                    "number, time, the call that followed it and what changed since; `since` shows "
                    "those changes as a diff, to review the session's work before keeping it. Use "
                    "rewind to go back to one.")
REWIND_DESC = ("Rewind changes: put the workspace back as it was at a checkpoint (see "
               "checkpoints), byte for byte; files deleted since come back, files created since "
               "go. A rewind is itself a checkpoint: rewind to the one it names to undo it. "
               "Ignored files (.gitignore, .git, node_modules) are never touched.")


def call_summary(name, args):
    """A call as a checkpoint names it: the tool and its command or path, shortened."""
    args = args if isinstance(args, dict) else {}
    what = next((args[k] for k in ("command", "path", "file_path", "notebook_path",
                                   "task_id", "checkpoint")
                 if isinstance(args.get(k), (str, int)) and not isinstance(args.get(k), bool)), "")
    return "%s %s" % (name, shorten(" ".join(str(what).split()), 80)) if what != "" else name


def relative_to_root(roots, path):
    """A path as checkpoints and rewind name it: relative to the workspace root holding it."""
    root = next((r for r in roots if is_within(path, r)), "/")
    return path[len(child_prefix(root)):] or "."


def session_checkpoints(session):
    """The session's Checkpoints (the server made them before the call), or ToolError when
    checkpoints are off."""
    checkpoints = session.checkpoints
    if not checkpoints.open_store():
        raise ToolError(IO_ERROR, "checkpoints are off: " + checkpoints.store.why)
    return checkpoints


def paths_shown(paths, roots):
    """Up to CHECKPOINT_NAMES_SHOWN paths, shown relative to their root, and how many more."""
    shown = [relative_to_root(roots, p) for p in paths[:CHECKPOINT_NAMES_SHOWN]]
    more = len(paths) - len(shown)
    return ", ".join(shown) + (" and %d more" % more if more > 0 else "")


def change_words(groups, roots):
    """[(word, paths)] in words, '2 added: a, b; 1 deleted: c' ('' when every list is empty)."""
    return "; ".join("%d %s: %s" % (len(paths), word, paths_shown(paths, roots))
                     for word, paths in groups if paths)


def paths_listed(pairs, roots):
    """[(path, why)] in words, 'a (why), b (why)', each path relative to its root."""
    return ", ".join("%s (%s)" % (relative_to_root(roots, p), why) for p, why in pairs)


def running_note(session):
    """The background tasks still running, named: their later writes are theirs."""
    tasks = session.running()
    if not tasks:
        return ""
    return "\nStill running: %s - what they write from now on is not undone." % ", ".join(
        "task %s (%s)" % (t.id, shorten(t.command, 60)) for t in tasks)


@tool("checkpoints", CHECKPOINTS_DESC, obj({
    "since": prop("integer", "Show the changes since this checkpoint as a diff (git apply -R takes"
                  " them back)."),
    "offset": prop("integer", "With since: files to skip (a cut diff's notice gives it).")}),
      notes("List workspace checkpoints", read_only=True), modes=DEFAULT,
      hint="review session changes, diff")
def tool_checkpoints(session, args, ctx):
    """checkpoints: each checkpoint, newest first, with what changed after it; what is covered.
    With since: the diff from that checkpoint to now instead."""
    checkpoints = session_checkpoints(session)
    roots = checkpoints.roots
    with checkpoints.held(ctx.cancelled):
        latest = checkpoints.current(ctx.cancelled)
        if args.get("since") is not None:
            if latest is None:
                raise ToolError(INVALID_INPUT, "cancelled while the workspace was being read")
            return checkpoint_diff(checkpoints, checkpoints.find(args["since"]), latest,
                                   args.get("offset") or 0, ctx.config.max_result_chars - 400)
        kept = list(checkpoints.list)
        store = checkpoints.store
        stored, budget, where = store.stored, store.budget, store.dir
    lines = ["Checkpoints of %s (one before each call that can change files; rewind puts one back):"
             % ", ".join(roots)]
    for k in range(len(kept) - 1, -1, -1):
        checkpoint, changes = kept[k], ""
        partial, followed = checkpoint.partial, checkpoint.followed
        if k + 1 < len(kept):
            diff = entry_changes(checkpoint, kept[k + 1], partial)
            words = change_words(zip(("added", "modified", "deleted"), diff), roots)
            changes = "%s- changed after it: %s" % (
                "(covers part: %s)  " % partial if partial else "", words or "nothing")
        lines.append("#%d  %s  %s  %s" % (
            checkpoint.number, time.strftime("%H:%M:%S", time.localtime(checkpoint.taken)),
            "before " + ", ".join(followed) if followed else "(the state now)", changes))
    if latest is not None:
        # (a directory at a time: no list of every entry at once)
        kinds, size = Counter(), 0
        for packed in latest.dirs.values():
            for entry in unpack_children(packed).values():
                # (a file not covered is not counted)
                kinds[entry.kind] += entry.kind != "f" or entry.data is not None
                size += entry.size if entry.kind == "f" else 0
        lines.append("Covered now: %d files, %d directories, %d symlinks (%s); the store keeps %s"
                     " of a %s budget in %s."
                     % (kinds["f"], kinds["d"], kinds["l"], human_size(size), human_size(stored),
                        human_size(budget), where))
        if latest.missed:
            lines.append("Not covered: %s."
                         % paths_listed(latest.missed[:CHECKPOINT_NAMES_SHOWN], roots))
        if latest.partial:
            lines.append("Not covered: %s." % latest.partial)
    lines.append("Never covered: files ignored by .gitignore, .git and node_modules.")
    return "\n".join(lines) + running_note(session)


def checkpoint_diff(checkpoints, target, now, offset, cap):
    """What changed from checkpoint `target` to `now` (the state just read) as git writes a
    diff: a header per file, mode lines, hunks of text, a line for a binary file or one the
    checkpoint did not cover; files past `cap` characters are left to a read-on notice."""
    # the files and links at the checkpoint and now
    old, cur = ({p: e for p, e in c.flat().items() if e.kind != "d"}
                for c in (target, now))
    paths = sorted(p for p in set(old) | set(cur)
                   if old.get(p, ())[:3] != cur.get(p, ())[:3])
    if offset < 0:
        raise ToolError(INVALID_INPUT, "offset %d must be 0 or more" % offset)
    readers, parts, size = {}, [], 0

    def file_diff(p):
        """One file's part: its header and mode lines, then its hunks or why they are not shown."""
        name = relative_to_root(checkpoints.roots, p)
        a, b = old.get(p), cur.get(p)
        text = git_header(name, a, b)
        try:
            # (a file the checkpoint did not cover has no bytes then)
            before = entry_bytes(a, lambda: checkpoints.bytes_of(p, a.data, readers)
                                 if a.data else None)
            after = entry_bytes(b, lambda: read_regular(p, name,
                                                        checkpoints.config.max_file_size)[0])
        except (OSError, ToolError) as e:
            text += "# not shown: %s\n" % (getattr(e, "message", None) or e.strerror or e)
            before = after = b""
        uncovered = a is not None and a.kind == "f" and not a.data
        text += git_body(name, before, after, target.number if uncovered else None)
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    try:
        for p in paths[offset:]:
            block = file_diff(p)
            if parts and size + len(block) > cap:
                break
            parts.append(block)
            size += len(block)
    finally:
        for reader in readers.values():
            reader.close()
    if not paths:
        return "Nothing changed since checkpoint %d." % target.number
    head = "Changes since checkpoint %d (%s; `git apply -R` takes them back):\n" % (
        target.number, plural(len(paths), "file"))
    body = "".join(parts)
    end = offset + len(parts)                   # the files shown end before this one
    if end < len(paths):
        body += "[files %d-%d of %d shown; read on with offset=%d]\n" % (
            offset + 1, end, len(paths), end)
    return head + body


def git_header(name, a, b):
    """A file's 'diff --git' line and its mode lines as git writes them (a, b: its entries
    at the checkpoint and now, None where it is not a file or link)."""
    text = "diff --git a/%s b/%s\n" % (name, name)
    if a is None:
        return text + "new file mode %s\n" % git_mode(b)
    if b is None:
        return text + "deleted file mode %s\n" % git_mode(a)
    if git_mode(a) != git_mode(b):
        return text + "old mode %s\nnew mode %s\n" % (git_mode(a), git_mode(b))
    return text


def entry_bytes(entry, read):
    """The bytes a diff compares for a checkpoint entry: None for no file, a link's target,
    or what read() gives for a file."""
    if entry is None:
        return None
    return os.fsencode(entry.data) if entry.kind == "l" else read()


def git_body(name, before, after, uncovered=None):
    """A file's hunks after its header, or why they are not shown: the checkpoint numbered
    `uncovered` did not cover it, or it is binary."""
    if uncovered is not None:
        return "# not shown: checkpoint %d did not cover it\n" % uncovered
    if b"\0" in (before or b"")[:8192] + (after or b"")[:8192]:
        old = "a/" + name if before is not None else "/dev/null"
        new = "b/" + name if after is not None else "/dev/null"
        return "Binary files %s and %s differ\n" % (old, new)
    return unified_diff(before, after, name)


def git_mode(entry):
    """The mode git gives a checkpoint entry: a link, an executable or a plain file."""
    return "120000" if entry.kind == "l" else "100755" if entry.mode & 0o111 else "100644"


@tool("rewind", REWIND_DESC, obj({
    "checkpoint": prop("integer", "The checkpoint's number (from checkpoints)."),
    "paths": prop("array", "Only these files or directories (default: the whole workspace).",
                  items={"type": "string"}),
    "dry_run": prop("boolean", "Only say what it would change.")}, ["checkpoint"]),
      notes("Rewind the workspace to a checkpoint", destructive=True), modes=DEFAULT,
      hint="undo shell changes")
def tool_rewind(session, args, ctx):
    """rewind: the workspace (or some paths of it) back to a checkpoint; the state before is a
    checkpoint."""
    checkpoints = session_checkpoints(session)
    within = [resolve_checked(session, ctx, p, "paths") for p in args.get("paths") or []]
    roots = checkpoints.roots
    with checkpoints.held(ctx.cancelled):
        target = checkpoints.find(args["checkpoint"])
        now = checkpoints.current(ctx.cancelled)
        if now is None:
            raise ToolError(INVALID_INPUT, "cancelled, or the session ended, while the workspace"
                            " was being read; nothing was rewound")
        if args.get("dry_run"):
            plan = checkpoints.rewind(target, now, within, ctx.files, dry=True)
            return "Dry run: rewinding to checkpoint %d would change %s.%s" % (
                target.number, paths_listed(plan[0], roots) or "nothing",
                "" if not plan[1] else " It could not: %s." % paths_listed(plan[1], roots))
        done, failed = checkpoints.rewind(target, now, within, ctx.files)
    words = {}
    for p, w in done:
        words.setdefault(w, []).append(p)
    text = "Rewound %s to checkpoint %d (%s): %s." % (
        ", ".join(relative_to_root(roots, p) for p in within) or "the workspace", target.number,
        time.strftime("%H:%M:%S", time.localtime(target.taken)),
        change_words(sorted(words.items()), roots) or "nothing differed")
    if failed:
        text += "\nNot restored: %s." % paths_listed(failed[:CHECKPOINT_NAMES_SHOWN], roots)
    if now.number != target.number:
        text += ("\nTo undo this rewind: rewind to checkpoint %d (the state just before it)."
                 % now.number)
    return text + running_note(session)


EDITOR_DESC = ("View, create and edit files. command=view shows a file with line numbers or lists "
               "a directory; create writes file_text to path; str_replace replaces the unique "
               "old_str with new_str; insert adds insert_text after line insert_line (0 = top); "
               "undo_edit takes back this session's last edit of path. Files must be viewed "
               "before they are edited.")


@tool("str_replace_editor", EDITOR_DESC, obj({
    "command": prop("string", "The operation.",
                    enum=["view", "create", "str_replace", "insert", "undo_edit"]),
    "path": PATH_PROP,
    "view_range": RANGE_PROP,
    "file_text": prop("string", "command=create: the complete file content."),
    "old_str": prop("string", "command=str_replace: the exact, unique text to replace."),
    "new_str": prop("string",
                    "command=str_replace: the replacement; command=insert: the text to insert."),
    "insert_line": prop("integer", "command=insert: insert after this line (0 = top of file)."),
    "insert_text": prop("string", "command=insert: the text to insert."),
    "replace_all": prop("boolean", "command=str_replace: replace every occurrence."),
    "dry_run": DRY_RUN_PROP,
}, ["command", "path"]), notes("Text editor", destructive=True), modes=COMPAT,
      goes_with=("view", "str_replace", "create_file"), hint="view or edit files")
def tool_str_replace_editor(session, args, ctx):
    """Anthropic's text-editor tool: one name, the same handlers underneath."""
    cmd = args["command"]
    handler, need = {
        "view": (tool_view, None), "str_replace": (tool_str_replace, "old_str"),
        "create": (functools.partial(tool_create_file, content_key="file_text"), "file_text"),
        "insert": (tool_insert, "insert_line"), "undo_edit": (tool_undo_edit, None)}[cmd]
    if need and args.get(need) is None:
        raise ToolError(INVALID_INPUT, "command %r needs the argument %r" % (cmd, need))
    return handler(session, args, ctx)


###############################################################################
# Tools: apply_patch ##########################################################
###############################################################################
# *** Begin Patch / *** Add File: P (every line '+') / *** Delete File: P /
# *** Update File: P [*** Move to: Q] then hunks: '@@' or '@@ header' lines (stacked to
# narrow where the hunk is), lines ' ' context, '-' removed, '+' added, and an optional
# '*** End of File' / *** End Patch. Every hunk of every file is located before anything
# is written; a patch lands whole or not at all.

class Hunk:
    """One '@@' section: the header lines that narrow where it applies, its lines as
    (kind, text) with kind ' ', '-' or '+', and whether it ends the file."""

    def __init__(self, header=None):
        self.headers = [header] if header else []
        self.lines = []
        self.eof = False

    def old(self):
        """The lines the hunk expects in the file (context and removed)."""
        return [t for k, t in self.lines if k != "+"]

    def label(self, k):
        """How messages name hunk k: its number and its @@ headers."""
        return "hunk %d%s" % (k, " (@@ %s)" % " @@ ".join(self.headers) if self.headers else "")


PatchOp = namedtuple("PatchOp", "kind path body move hunks", defaults=(None, None, None))
PatchOp.__doc__ = """One section of a patch: kind 'add' (body: its lines), 'delete', or
'update' (move: the '*** Move to' path or None; hunks: [Hunk])."""


class PatchReader:
    """A patch's text, read section by section: read() gives its operations."""

    def __init__(self, text):
        """The patch's lines, from `*** Begin Patch` to `*** End Patch` (blank lines around
        them dropped), or INVALID_INPUT saying which is missing."""
        lines = text.replace("\r\n", "\n").strip().split("\n")
        heredoc = re.match(r"^\s*(?:apply_patch\s*)?<<-?\s*(['\"]?)(\w+)\1\s*$", lines[0])
        if heredoc and len(lines) > 2 and lines[-1].strip() == heredoc.group(2):
            # the patch wrapped as a heredoc, as some models send it
            lines = lines[1:-1]
        if lines[0].strip() != "*** Begin Patch":
            raise ToolError(INVALID_INPUT, "a patch starts with the line '*** Begin Patch' (and"
                            " ends with '*** End Patch')")
        if lines[-1].strip() != "*** End Patch":
            raise ToolError(INVALID_INPUT, "a patch ends with the line '*** End Patch'; the last"
                            " line is %r" % shorten(lines[-1], 80))
        self.lines = lines
        self.i, self.end = 1, len(lines) - 1           # between Begin and End

    def read(self):
        """[PatchOp] of the patch; ToolError(INVALID_INPUT) naming the line that breaks
        the format."""
        ops = []
        while self.i < self.end:
            line = self.marker()
            if line.startswith("*** Add File: "):
                ops.append(self.add_section(line[14:].strip()))
            elif line.startswith("*** Delete File: "):
                ops.append(PatchOp("delete", line[17:].strip()))
                self.i += 1
            elif line.startswith("*** Update File: "):
                ops.append(self.update_section(line[17:].strip()))
            elif not line:
                self.i += 1
            else:
                raise self.bad(self.i, "expected '*** Add File: ', '*** Delete File: ' or"
                                       " '*** Update File: '")
        if not ops:
            raise ToolError(INVALID_INPUT, "the patch changes no file")
        return ops

    def marker(self):
        """The line being read, stripped: marker lines may come padded. The last line is
        '*** End Patch', which ends every section's loop on its own."""
        return self.lines[self.i].strip()

    def bad(self, k, why):
        """INVALID_INPUT naming patch line k (from 0) and what is wrong with it."""
        return ToolError(INVALID_INPUT, "patch line %d (%s): %s"
                         % (k + 1, shorten(repr(self.lines[k]), 80), why))

    def add_section(self, path):
        """The PatchOp of an Add File section: every line starts with '+'."""
        body, self.i = [], self.i + 1
        while not self.marker().startswith("*** "):
            if not self.marker():
                self.i += 1                             # a blank line between sections
                continue
            if not self.lines[self.i].startswith("+"):
                raise self.bad(self.i, "every line of an added file starts with '+'")
            body.append(self.lines[self.i][1:])
            self.i += 1
        return PatchOp("add", path, body=body)

    def update_section(self, path):
        """The PatchOp of an Update File section."""
        move, self.i = None, self.i + 1
        if self.marker().startswith("*** Move to: "):
            move, self.i = self.marker()[13:].strip(), self.i + 1
        hunks = []
        while not self.marker().startswith("*** ") or self.marker() == "*** End of File":
            self.hunk_line(self.lines[self.i], hunks)
            self.i += 1
        # blank lines before the next marker: not context
        for hunk in hunks:
            while hunk.lines[-1:] == [(" ", "")] and any(k != " " for k, _ in hunk.lines):
                hunk.lines.pop()
        if not any(h.lines for h in hunks):
            raise self.bad(self.i - 1, "the update of %s has no hunk" % path)
        return PatchOp("update", path, move=move, hunks=hunks)

    def header_line(self, header, hunks):
        """An '@@ header' line: a new hunk, or (stacked on an empty one) a narrower one."""
        if hunks and not hunks[-1].lines and not hunks[-1].eof:
            hunks[-1].headers.append(header)
        else:
            hunks.append(Hunk(header))

    def hunk_line(self, line, hunks):
        """Take one line of an Update section into `hunks`."""
        if line.lstrip().startswith("@@"):
            self.header_line(line.strip()[2:].strip(), hunks)
        elif line.strip() == "*** End of File":
            if not hunks:
                raise self.bad(self.i, "'*** End of File' closes a hunk, and none is open")
            hunks[-1].eof = True
        elif line[:1] in (" ", "-", "+", ""):
            if not hunks or hunks[-1].eof:
                if hunks and not line:
                    return                              # a blank line after *** End of File
                hunks.append(Hunk())
            hunks[-1].lines.append((line[:1] or " ", line[1:]))
        else:
            raise self.bad(self.i, "a hunk line starts with ' ' (context), '-' (removed) or"
                                   " '+' (added)")


class PatchedText:
    """One file's text under a patch's hunks, applied in order: each hunk's old lines are
    found by the one matcher at or after where the hunk before ended, past its '@@
    header' lines; a hunk found at a relaxed level is merged into the file's lines as
    an edit is (EditMerge; new lines with an indentation the match does not map come
    as the patch has them, as Codex writes them). Line endings are kept (a CRLF file
    stays CRLF). `notes` gets a line for each hunk found at a relaxed level."""

    def __init__(self, text, shown):
        self.shown = shown
        self.nl = "\r\n" if "\r\n" in text else "\n"
        self.final = text.endswith(self.nl) or text == ""
        self.lines = text.split(self.nl)
        if self.final:
            self.lines.pop()
        self.index = LineIndex(self.lines)
        # the file's unit of indentation, for hunks merged at a relaxed level
        self.step = indent_step(self.lines)
        self.cursor = 0
        self.notes = []

    def apply(self, hunks):
        """The text with every hunk applied, or the ToolError of the first that does not apply."""
        lines, edits = self.lines, []
        for k, hunk in enumerate(hunks, 1):
            at, end, level = self.locate(hunk, hunk.label(k))
            old, new, ops = hunk_ops(hunk.lines)
            if level:
                try:
                    new = EditMerge(lines[at:end], old, new, ops, level, what="the hunk",
                                    as_sent=True, file_step=self.step).lines()
                except ToolError as e:
                    raise ToolError(e.code, "%s, %s: %s" % (self.shown, hunk.label(k), e.message))
                self.notes.append("hunk %d matched %s" % (k, MATCH_LEVELS[level].name))
            edits.append((at, end, new))
            if end > at or hunk.headers:
                # a bare addition (at the end) moves no later hunk's search
                self.cursor = end
        for at, end, new in sorted(edits, key=lambda e: e[0], reverse=True):
            lines[at:end] = new
        return self.nl.join(lines) + (self.nl if lines and self.final else "")

    def locate(self, hunk, label):
        """(start, end, level) of the lines `hunk`'s old lines stand for; ToolError naming
        the file, the hunk and its header or first line that was not found, or every
        place an ambiguous hunk matches."""
        lines, cursor = self.lines, self.after_headers(hunk, label)
        old = hunk.old()
        # only additions: after the headers, or at the end
        if not old:
            at = cursor if hunk.headers and not hunk.eof else len(lines)
            return at, at, 0
        if not any(map(str.strip, old)):                # blank lines only: as they are
            n, level, elsewhere = len(old), 0, []
            first = max(cursor, len(lines) - n) if hunk.eof else cursor
            hits = [(i, i + n) for i in range(first, len(lines) - n + 1)
                    if lines[i:i + n] == old]
        else:
            level, hits, elsewhere = find_lines(self.index, old, cursor, hunk.eof)
        if len(hits + elsewhere) == 1:
            if hunk.headers and hits[0][0] == cursor and self.adds_after_blanks(hunk):
                raise ToolError(
                    STR_REPLACE_AMBIGUOUS, "%s, %s: only blank lines stand between its @@ header"
                    " and the lines it adds, so whether they go before or after those blank lines"
                    " is not known (a blank line after '@@' may be spacing); give a context line"
                    " that is not blank, or drop the blank line; nothing was written"
                    % (self.shown, label))
            return hits[0] + (level,)
        if hits:
            raise ToolError(STR_REPLACE_AMBIGUOUS, "%s, %s matches %s at lines %s; add context"
                            " lines or an '@@ header' line (e.g. @@ def name) to pick one;"
                            " nothing was written"
                            % (self.shown, label, MATCH_LEVELS[level].name,
                               ", ".join(str(i + 1) for i, _ in sorted(hits + elsewhere)[:20])))
        raise self.miss(old, cursor, label)

    @staticmethod
    def adds_after_blanks(hunk):
        """Whether the hunk opens with blank context lines followed by a line it adds."""
        lead = next((k for k, (kind, text) in enumerate(hunk.lines)
                     if kind != " " or text.strip()), 0)
        return bool(lead) and hunk.lines[lead][0] == "+"

    def after_headers(self, hunk, label):
        """Where a hunk's old lines are looked for: after its @@ header lines, each found
        after the one before (at any level but blank lines), from the cursor; ToolError
        naming the header not found."""
        lines, cursor = self.lines, self.cursor
        for h in hunk.headers:
            # the first line that is the header at the first level where one is
            at = next((j for _, norm, _ in MATCH_LEVELS[:BLANK_LEVEL]
                       for j in range(cursor, len(lines)) if norm(lines[j]) == norm(h)),
                      None)
            if at is None:
                raise ToolError(STR_REPLACE_NOT_FOUND, "%s, %s: its header line %r was not found%s;"
                                " nothing was written"
                                % (self.shown, label, shorten(h, 120), self.searched_from(cursor)))
            cursor = at + 1
        return cursor

    def miss(self, old, cursor, label):
        """The ToolError of a hunk that is nowhere: its first line that is not found after
        the ones before it, and the closest region of the file."""
        got = 0
        while got < len(old) and (not any(map(str.strip, old[:got + 1])) or
                                  find_lines(self.index, old[:got + 1], cursor)[1]):
            got += 1
        after = " after the %s before it" % plural(got, "line") if got else ""
        what = "its lines were not found in that order after the hunks before it"
        if got < len(old):
            what = "the line %r was not found%s" % (shorten(old[got], 120), after)
        return ToolError(STR_REPLACE_NOT_FOUND, "%s, %s: %s%s; nothing was written.%s"
                         % (self.shown, label, what, self.searched_from(cursor),
                            closest_region("\n".join(self.lines), "\n".join(old), what="the hunk")))

    @staticmethod
    def searched_from(cursor):
        """The words a miss adds when the search for a hunk started past earlier hunks."""
        if cursor:
            return " (searching from line %d, after the hunks before it)" % (cursor + 1)
        return ""


class PatchPlan:
    """What a patch will do, every path resolved and checked, every hunk located,
    sections applied in order to what the sections before left (a file may come
    twice): its writes (for write_edit), the summary lines as Codex prints them (every A,
    then every M - a moved file by its new name - then every D) and how hunks that did not
    match exactly were placed, a line each. Nothing is touched here."""

    def __init__(self, session, ctx, ops):
        self.session, self.ctx = session, ctx
        self.matched = []
        lines = {"A": [], "M": [], "D": []}
        # real -> bytes as the sections so far leave it (None: no file), in the order first met
        self.now = {}
        # real -> (bytes, stat) on disk before the patch, or None
        self.before = {}
        # real -> the permission bits of a file the patch makes
        self.shown, self.modes = {}, {}
        for op in ops:
            shown, move = op.path, op.move
            real = resolve_checked(session, ctx, shown)
            if op.kind == "add":
                self.current(real, shown, "*** Add File", overwrite=True)
                body = "\n".join(op.body) + "\n" if op.body else ""
                self.now[real] = encode_text(body, "input")
                self.modes[real] = 0o644
                lines["A"].append(shown)
                continue
            text = self.current(real, shown, "*** %s File" % op.kind.title())
            if op.kind == "delete":
                self.now[real] = None
                lines["D"].append(shown)
                continue
            patched = PatchedText(text.decode("utf-8", "surrogateescape"), shown)
            data = encode_text(patched.apply(op.hunks), "input")
            name = move or shown                    # as the summary names it
            self.matched += ["%s: %s" % (name, n) for n in patched.notes]
            if move:
                target = resolve_checked(session, ctx, move, "*** Move to")
                self.current(target, move, "*** Move to", overwrite=True)
                before = self.before[real]      # (None: added earlier in the patch)
                self.modes[target] = stat.S_IMODE(before[1].st_mode) if before else 0o644
                self.now[target], self.now[real] = data, None
            else:
                self.now[real] = data
            lines["M"].append(name)
        self.summary = ["%s %s" % (kind, shown) for kind in "AMD" for shown in lines[kind]]

    def current(self, real, shown, section, overwrite=False):
        """What `real` holds as the sections so far leave it: bytes, or None when there
        is no file (an Update or Delete then refuses, PATH_NOT_FOUND). What an Add File or
        Move to replaces (overwrite) is read as Codex does, but only a file this session
        has seen unchanged (create_file's rule: FILE_NOT_VIEWED, FILE_CHANGED)."""
        session, ctx = self.session, self.ctx
        if real not in self.now:
            self.shown[real] = shown
            exists = existing_kind(real, shown) is not None
            if not exists and not overwrite:
                raise ToolError(PATH_NOT_FOUND, "%s: %s does not exist; nothing was written"
                                % (section, shown))
            self.before[real] = self.now[real] = None
            if exists:
                if overwrite:
                    require_viewed(session, ctx, real, shown)
                    check_unchanged(session, ctx, real, shown)
                self.before[real] = read_regular(real, shown, ctx.config.max_file_size)
                self.now[real] = self.before[real][0]
        if self.now[real] is None and not overwrite:
            raise ToolError(PATH_NOT_FOUND, "%s: %s does not exist (an earlier section of the patch"
                            " removed it); nothing was written" % (section, shown))
        return self.now[real]

    @property
    def writes(self):
        """The changes that take every touched file to its final state, as write_edit takes
        them (a file made and removed again in one patch is left alone)."""
        out = []
        for real, data in self.now.items():
            before = self.before[real]
            if data is None and before is None:
                continue
            out.append(FileEdit(real, self.shown[real], data, before[0] if before else None,
                                self.modes.get(real, 0o644) if before is None else None))
        return out


PATCH_DESC = ("Edit, add, delete and move files with one patch in the apply_patch format: "
              "'*** Begin Patch', then per file '*** Add File: path' (every line starting "
              "with +), '*** Delete File: path' or '*** Update File: path' (optionally "
              "'*** Move to: new/path') followed by hunks: '@@' (or '@@ def name' to say "
              "where), lines ' ' context, '-' removed, '+' added, three context lines around "
              "each change; then '*** End Patch'. Context is found as str_replace finds "
              "old_str (slips forgiven where one place fits). All files change or none does; "
              "no prior view is needed.")


@tool("apply_patch", PATCH_DESC, obj({
    "input": prop("string", "The whole patch, from '*** Begin Patch' to '*** End Patch'."),
    "dry_run": DRY_RUN_PROP,
}, ["input"]), notes("Apply a patch", destructive=True), hint="apply a diff patch")
def tool_apply_patch(session, args, ctx):
    """Codex's apply_patch: parse; resolve and scope-check every path; then, under every
    file's edit lock (taken in one order), plan every file (existence, hunks) and write."""
    ops = PatchReader(args["input"]).read()
    reals = set(resolve_checked(session, ctx, op.path) for op in ops)
    reals.update(resolve_checked(session, ctx, op.move, "*** Move to") for op in ops if op.move)
    with contextlib.ExitStack() as locks:
        for real in sorted(reals):
            locks.enter_context(ctx.files.lock(real))
        plan = PatchPlan(session, ctx, ops)
        note = write_edit(session, ctx, "apply_patch", plan.writes, args.get("dry_run"))
    matched = "".join("\n(%s)" % m for m in plan.matched)
    if args.get("dry_run"):
        return note + "\n(%s)" % "; ".join(plan.summary) + matched
    return "Success. Updated the following files:\n" + "\n".join(plan.summary) + matched + note


###############################################################################
# Tools: notebooks ############################################################
###############################################################################
# view renders a notebook (Notebook, in Tools: images and notebooks): per cell a header,
# its numbered source and its outputs (text bounded, errors short, PNG/JPEG as images).
# notebook_edit rewrites the bytes of one cell only - every other byte of the file (other cells,
# key order, indentation, nbformat) stays as it was - from the cells' spans found with raw_decode.


NOTEBOOK_DESC = ("Edit one cell of a Jupyter notebook (.ipynb): replace its source, insert a new "
                 "cell after it, or delete it (view renders a notebook's cells and outputs; "
                 "view_range counts cells). Other cells stay byte for byte; an edited code cell's "
                 "outputs and execution count are cleared. View the notebook first.")


@tool("notebook_edit", NOTEBOOK_DESC, obj({
    "path": PATH_PROP,
    "cell_id": prop("string", "The cell's id, as view shows it."),
    "cell_number": prop("integer",
                        "The cell's number as view shows it, from 1 (when it has no id)."),
    "new_source": prop("string", "The cell's new source (replace, insert)."),
    "cell_type": prop("string", "Needed to insert; on replace, changes the cell's type.",
                      enum=["code", "markdown", "raw"]),
    "edit_mode": prop("string", "replace (default), insert (after the cell named; at the top if"
                      " none) or delete.", enum=["replace", "insert", "delete"]),
    "dry_run": DRY_RUN_PROP,
}, ["path"]), notes("Edit a notebook cell", destructive=True), hint="edit jupyter cell")
def tool_notebook_edit(session, args, ctx):
    """Replace, insert or delete one cell of a notebook, leaving every other byte."""
    shown = args["path"]
    mode = args.get("edit_mode") or "replace"
    real = resolve_checked(session, ctx, shown)
    if not real.endswith(".ipynb"):
        raise ToolError(INVALID_INPUT, "%s is not a notebook (.ipynb); edit it with str_replace"
                        % shown)
    with ctx.files.lock(real):
        text = load_for_edit(session, ctx, real, shown)
        try:
            notebook = Notebook(text)
        except (ValueError, RecursionError) as e:
            raise ToolError(INVALID_INPUT, "%s is not a notebook that can be edited: %s"
                            % (shown, e))
        k = notebook.find(args, shown, mode)
        updated = notebook.edited(k, mode, args)
        note = write_edit(session, ctx, "notebook_edit",
                          [FileEdit(real, shown, encode_text(updated, "new_source"),
                                    encode_text(text))], args.get("dry_run"))
    if args.get("dry_run"):
        return note
    done = {"replace": "Replaced cell %d", "insert": "Inserted a cell as cell %d",
            "delete": "Deleted cell %d"}[mode]
    return done % (k + 2 if mode == "insert" else k + 1) + " of %s%s" % (shown, note)


###############################################################################
# Tools: shell ################################################################
###############################################################################
# bash in the foreground (progress, cancel, timeout) or as a background task, and the
# task tools that read, feed and stop it; the runner is the Shell layer's.

PROGRESS_TAIL_BYTES = 4096
TASK_INPUT_WAIT_S = 5.0       # task_input: how long a task may take to read its input
TASK_SETTLE_S = 0.15          # ... then, without wait_for/wait_ms: quiet this long after output
TASK_SETTLE_MAX_S = 2.0       # ... or at most this long


def start_command(session, script, sandbox=None, stdin="null"):
    """Start the session's shell on `script` in its cwd (sandboxed when on); BASH_START_FAILED
    when it cannot start."""
    cwd = session.get_cwd()
    try:
        return start_process(script, cwd, sandbox, stdin, command_environ(session.config))
    except OSError as e:
        raise ToolError(BASH_START_FAILED,
                        "could not start %s in %s: %s" % (SHELL, cwd, e.strerror or e))


class ProgressLines:
    """Tell the client how a command is getting on, at most ~10 times a second: a
    short status ('12 lines, 3.4 KB so far; last: <its last line, cut to ~200
    characters>'), never the output itself, which belongs in the result. Keeps
    counters and the last PROGRESS_TAIL_BYTES only; the cwd sentinel never shows."""

    def __init__(self, ctx, marker):
        self.ctx, self.marker = ctx, marker
        self.tail = bytearray()
        self.lines = self.size = 0
        self.last = 0.0
        self.muted = False              # the call has returned (the command was handed off)

    def __call__(self, is_err, data):
        if self.muted:
            return
        self.size += len(data)
        self.lines += data.count(b"\n")
        self.tail += data
        if len(self.tail) > 2 * PROGRESS_TAIL_BYTES:
            del self.tail[:-PROGRESS_TAIL_BYTES]
        now = time.monotonic()
        if now - self.last < PROGRESS_INTERVAL_S:
            return
        shown = [l for l in bytes(self.tail).split(b"\n") if l.strip() and self.marker not in l]
        if not shown:
            return
        self.last = now
        last = shown[-1].decode("utf-8", "replace").strip()
        self.ctx.progress("%s, %s so far; last: %s" % (
            plural(self.lines, "line"), human_size(self.size),
            last if len(last) <= PROGRESS_LINE_CHARS else last[:PROGRESS_LINE_CHARS] + "..."))


def ending_line(why, timeout_ms, out, err):
    """The line a foreground command's answer starts with when it did not just exit."""
    if why == "timeout":
        return "Command timed out after %d ms and was killed; output so far is below.%s" % (
            timeout_ms, " It may be waiting for input: run it with interactive: true"
                        " (tty: true if it wants a terminal) and answer with task_input."
                        if looks_like_prompt(out, err) else "")
    if why == "stopped":
        return "Command was cancelled and killed."
    return ""


BASH_DESC = ("Run a shell command (%s -c) in the session's working directory and return its exit "
             "code, stdout and stderr. Each call is a new shell: the working directory persists "
             "between calls (cd moves it), environment variables and aliases do not. Commands do "
             "not get the server's BORIS_* variables or those named like a secret (%s). stdin is "
             "/dev/null, so a prompt fails at once; for REPLs, prompts and debuggers set "
             "interactive (send input with task_input), or tty for a terminal. A command is "
             "killed, with everything it started, after `timeout` ms. One still running after %s "
             "(or yield_ms) is handed off, not killed: the call returns its output so far and a "
             "task_id to follow with task_output. Start servers and watchers with "
             "run_in_background. Pipe long output through tail, head or grep: the middle of a long "
             "output is left out.")


def bash_description(config):
    """BASH_DESC naming the shell this machine has (/bin/sh where there is no /bin/bash),
    the variables commands do not get and the hand-off time."""
    kept = "; kept: " + ", ".join(config.shell_env_keep) if config.shell_env_keep else ""
    desc = BASH_DESC % ("bash" if SHELL == "/bin/bash" else SHELL, ", ".join(SECRET_NAMES) + kept,
                        "%g s" % config.handoff if config.handoff else "yield_ms")
    if SHELL != "/bin/bash":
        desc += (" This machine has no /bin/bash: commands run under /bin/sh,"
                 " so bash-only syntax fails.")
    return desc


@tool("bash", bash_description, lambda config: obj({
    "command": prop("string", "The shell command to run."),
    "timeout": prop("integer", "Timeout in milliseconds (default %d, max %d)."
                    % (int(config.timeout * 1000), BASH_MAX_TIMEOUT_MS)),
    "run_in_background": prop("boolean", "Start the command and return its task_id at once."),
    "interactive": prop("boolean",
                        "Keep its stdin open for task_input (implies run_in_background)."),
    "tty": prop("boolean", "Run it on a pseudo-terminal (80x24, TERM=dumb; implies interactive)."
                           " Escape sequences are removed from its output."),
    "description": prop("string", "A few words saying what the command does (for logs)."),
    "yield_ms": prop("integer", "Hand the command off to the background after this many"
                                " milliseconds instead of %s." % (
                                    "%g s" % config.handoff if config.handoff else "never")),
}, ["command"]), notes("Run shell command", destructive=True, open_world=True), lane="shell",
      hint="run shell command, tests")
def tool_bash(session, args, ctx):
    """bash: run a command in the session's shell state (cwd) within its timeout (the
    `timeout` argument, else --timeout; at most BASH_MAX_TIMEOUT_MS), in the foreground
    until it ends or outlives the hand-off time (yield_ms, else --handoff), then as a
    task of the session; interactive, tty and run_in_background ones are tasks from the
    start. A cancel before the hand-off kills it; the hand-off kills nothing."""
    command, yield_ms = args["command"], args.get("yield_ms")
    if not command.strip():
        raise ToolError(BASH_EMPTY_COMMAND, "command is empty; give a shell command to run")
    timeout_ms = args.get("timeout", int(ctx.config.timeout * 1000))
    if timeout_ms <= 0:
        raise ToolError(INVALID_INPUT,
                        "timeout %d ms must be above 0 (it is in milliseconds, at most %d)"
                        % (timeout_ms, BASH_MAX_TIMEOUT_MS))
    if yield_ms is not None and yield_ms < 0:
        raise ToolError(INVALID_INPUT, "yield_ms %d must be 0 or more (milliseconds before the"
                        " command is handed off to the background)" % yield_ms)
    if timeout_ms > BASH_MAX_TIMEOUT_MS:
        said = ("(timeout %d ms is over the most a command may run, %d ms,"
                " which is its timeout)\n" % (timeout_ms, BASH_MAX_TIMEOUT_MS))
        return said + tool_bash(session, dict(args, timeout=BASH_MAX_TIMEOUT_MS), ctx)
    if any(args.get(k) for k in ("tty", "interactive", "run_in_background")):
        return start_task(session, command, ctx, args)
    handoff = yield_ms / 1000.0 if yield_ms is not None else ctx.config.handoff or None
    marker = ("__BORIS_CWD_%s__" % session.nonce).encode()
    script = ("%s\n__boris_status=$?\nprintf '\\n%%s%%s\\n' '%s' \"$PWD\"\n"
              "exit $__boris_status\n" % (command, marker.decode()))
    proc = start_command(session, script, ctx.sandbox)
    task = Task(command, proc, "its timeout (%d ms)" % timeout_ms)
    task.marker = marker
    progress = ProgressLines(ctx, marker) if ctx.wants_progress else None
    session.hold_foreground(proc)
    task.start(task.started + timeout_ms / 1000.0, progress)
    kept = task.follow(session, ctx.cancelled, handoff)
    if kept is None:
        return handed_off(task, ctx, timeout_ms, progress)
    return ended_answer(session, task, ctx, timeout_ms, kept and (
        "(not handed off to the background at %g s: %s; it ran in the foreground)"
        % (handoff, kept)))


def ended_answer(session, task, ctx, timeout_ms, kept):
    """The answer of a command that ended in the foreground: how it ended, its output, and
    the line `kept` saying why it was not handed off, if any. Its cd moves the session."""
    out, err = task.take()
    head = [ending_line(task.why, timeout_ms, out, err), describe_exit(task.proc), kept]
    if task.cwd and task.cwd != session.get_cwd() and os.path.isdir(task.cwd):
        session.set_cwd(task.cwd)
        head.append("cwd: %s" % task.cwd)
    body, notice = render_output(out, err, output_budget(ctx))          # (never empty)
    hint = ctx.sandbox.hint(body) if task.proc.returncode else ""
    return read_on("\n".join(line for line in head + [body, hint] if line), notice)


def handed_off(task, ctx, timeout_ms, progress):
    """The answer of a command handed off: the output so far, and how to follow it.
    Its progress notifications stop: the call they belong to is over."""
    if progress is not None:
        progress.muted = True
    out, err = task.take()
    body, notice = render_output(out, err, output_budget(ctx))
    return read_on("Still running after %.1f s, so it was handed off as background task %s"
                   " (nothing was killed; its output so far is below). Follow it with"
                   " task_output(task_id=%r, wait_for=\"<regex>\" or wait_ms=<ms>); stop it with"
                   " task_stop. Its timeout (%d ms from its start) still ends it, and its cd does"
                   " not move this session.\n%s" % (
                       time.monotonic() - task.started, task.id, task.id, timeout_ms, body), notice)


def waiting_lane(args):
    """The pool lane of task_output and task_input: a call that may wait (wait_ms,
    wait_for) runs in the shell lane, a quick read beside it."""
    return "shell" if args.get("wait_ms") or args.get("wait_for") else "quick"


def looks_like_prompt(out, err):
    """Whether a command's output ends like a prompt waiting for an answer: a last
    line with no newline ending in ':', '?', '>', '$', '#' or ']'."""
    for cap in (out, err):
        tail = bytes(cap.tail[-200:]).decode("utf-8", "replace")
        if (tail and not tail.endswith("\n")
                and tail.rstrip()[-1:] in (":", "?", ">", "$", "#", "]")):
            return True
    return False


def task_refused(why, what):
    """The error of a background task the session cannot take now (add_task's `why`)."""
    if why.startswith("the session"):
        return ToolError(BASH_START_FAILED, "%s; %s" % (why, what))
    return ToolError(BASH_TASK_LIMIT,
                     "%s; %s: wait for one with task_output or run this one in the foreground"
                     % (why, what))


def start_task(session, command, ctx, args):
    """Start `command` as a background task of the session and say how to follow it;
    at most MAX_BACKGROUND_TASKS run at once. Its stdin, as bash's arguments ask: a
    terminal (tty), a pipe (interactive) or /dev/null (run_in_background)."""
    stdin = "tty" if args.get("tty") else "pipe" if args.get("interactive") else "null"
    why = session.add_task(None)
    if why:
        raise task_refused(why, "no background task was started")
    proc = start_command(session, command, ctx.sandbox, stdin)
    timeout = ctx.config.background_task_timeout
    task = Task(command, proc, "the background task timeout (%g s)" % timeout, stdin)
    task.start(task.started + timeout if timeout else None)
    why = session.add_task(task)
    if why:                                    # it changed while the task started: never orphaned
        kill_all([task])
        raise task_refused(why, "the task was started and stopped again")
    return ("Started background task %s (pid %d%s). Read its output with task_output(task_id=%r)%s;"
            " its cd does not move this session." % (
                task.id, proc.pid,
                {"pipe": ", interactive", "tty": ", on a terminal"}.get(stdin, ""), task.id,
                "; give it input with task_input" if stdin != "null" else ""))


def task_status(task):
    """'status: ...' of a task, first line of every task_output answer."""
    runtime = time.monotonic() - task.started
    if not task.done.is_set():
        return "status: running (%.1f s)" % runtime
    if task.why == "timeout":
        return "status: killed by %s; %s" % (task.limit, describe_exit(task.proc))
    if task.why == "stopped":
        return "status: stopped; %s" % describe_exit(task.proc)
    return "status: completed; %s (after %.1f s)" % (describe_exit(task.proc), runtime)


def find_task(session, task_id):
    """The session's task `task_id`; BASH_TASK_NOT_FOUND listing the ones there are."""
    task, known = session.task(task_id)
    if task is None:
        raise ToolError(BASH_TASK_NOT_FOUND, "no background task %r in this session (running or"
                        " unread: %s); a completed task is forgotten once its output is read; call"
                        " task_output without task_id to list the tasks"
                        % (task_id, ", ".join(known) or "none"))
    return task


def list_tasks(session):
    """One line per task of the session: id, status and command."""
    tasks = session.task_list()
    if not tasks:
        return "No background tasks in this session."
    return "\n".join("%s  %s  %s" % (t.id, task_status(t)[8:], t.command[:200]) for t in tasks)


def output_budget(ctx):
    """Characters of command output a result may carry (the rest of the cap is its header)."""
    return max(2000, ctx.config.max_result_chars - 1000)


def task_answer(task, session, ctx):
    """A task's status, its command and the output not returned before; a finished
    task is forgotten once it is read."""
    body, notice = render_output(*task.take(), total=output_budget(ctx))
    if task.stdin == "tty":
        body = terminal_text(body)
    if task.done.is_set():
        session.drop_task(task)
    return read_on("%s\ncommand: %s\n%s" % (task_status(task), shorten(task.command), body), notice)


def output_test(ctx, pattern, deadline):
    """text -> whether a line of text (its first WAIT_FOR_LINE_CHARS) matches the
    wait_for `pattern`. A literal is tested here with `in`; a regex only ever runs
    in a helper (ctx.helpers), bounded by `deadline` and cancel, and is checked
    there once now, so a malformed one is an error at once."""
    check_pattern(pattern, "wait_for")
    if not set(pattern) & _REGEX_META:
        if "\n" in pattern:       # a literal that spans lines is looked for across them
            return lambda text: pattern in terminal_text(text)
        return lambda text: any(pattern in line[:WAIT_FOR_LINE_CHARS] for line in text.splitlines())

    def matches(text):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        items, _ = ctx.helpers.run({"op": "match", "pattern": pattern, "text": text},
                                   ctx.cancelled, left)
        return items == [True]
    ctx.helpers.run({"op": "match", "pattern": pattern, "text": ""}, ctx.cancelled,
                    SEARCH_TIMEOUT_S)
    return matches


TASK_DESC = ("Read the output of a background bash task or process: its status first ('running', "
             "or 'completed' with the exit code), then only the output not returned by an earlier "
             "call; wait_ms or wait_for (e.g. 'listening on|error') waits for more. A finished "
             "task is forgotten once read.")


@tool("task_output", TASK_DESC, obj({
    "task_id": prop("string", "The task_id bash returned (omit it to list the session's tasks)."),
    "wait_ms": prop("integer", "Wait up to this many milliseconds for the task to finish"
                               " (default 0, or up to 600000 with wait_for)."),
    "wait_for": prop("string", "Return as soon as new output matches this regular expression."),
}), notes("Read background task output", read_only=True), lane=waiting_lane, goes_with=("bash",),
      hint="background task output")
def tool_task_output(session, args, ctx):
    """task_output: a task's new output (waiting as asked), or the list of tasks without an id."""
    if not args.get("task_id"):
        return list_tasks(session)
    task = find_task(session, args["task_id"])
    await_task(task, ctx, args.get("wait_for") or None, args.get("wait_ms"), settle=False)
    return task_answer(task, session, ctx)


def await_task(task, ctx, wait_for, wait_ms, settle):
    """Wait until the task ends, its new output matches `wait_for`, `wait_ms` pass or
    the call is cancelled. wait_ms defaults to 0 (600 s with wait_for); settle=True
    (task_input without either) waits up to TASK_SETTLE_MAX_S for an answer to come
    and then go quiet for TASK_SETTLE_S."""
    settle = settle and wait_ms is None and not wait_for
    deadline = time.monotonic() + wait_budget_ms(wait_ms, wait_for, settle) / 1000.0
    watch = OutputWatch(output_test(ctx, wait_for, deadline) if wait_for else None, settle)
    while not task.done.is_set() and not ctx.cancelled.is_set() and time.monotonic() < deadline:
        if watch.answered(task):
            return
        # a cancel frees the worker
        task.done.wait(min(0.05, max(0.0, deadline - time.monotonic())))


def wait_budget_ms(wait_ms, wait_for, settle):
    """How long await_task may wait: wait_ms, or TASK_SETTLE_MAX_S to settle, or the
    longest wait with wait_for (0 without), at most BASH_MAX_TIMEOUT_MS."""
    if settle:
        return TASK_SETTLE_MAX_S * 1000
    return min(max(0, wait_ms or (BASH_MAX_TIMEOUT_MS if wait_for else 0)), BASH_MAX_TIMEOUT_MS)


class OutputWatch:
    """What await_task waits for in a task's recent output: a wait_for match, or
    (settle) an answer that has come and gone quiet for TASK_SETTLE_S."""

    def __init__(self, matches, settle):
        self.matches, self.settle = matches, settle
        self.seen, self.quiet_since = None, None

    def answered(self, task):
        """Whether the output now holds what is awaited."""
        recent = task.out.recent() + "\n" + task.err.recent()
        changed, self.seen = recent != self.seen, recent
        if self.matches is not None and changed and self.matches(recent):
            return True
        if not self.settle or not recent.strip():
            return False
        if changed:
            self.quiet_since = time.monotonic()
        return time.monotonic() - self.quiet_since >= TASK_SETTLE_S


TASK_INPUT_DESC = ("Type into an interactive background task (bash with interactive or tty true): "
                   "writes `input` to its stdin, then answers like task_output - status, then only "
                   "the new output - returning once the answer has come and gone quiet, or when "
                   "wait_for matches. Use it for REPLs, prompts and debuggers.")


@tool("task_input", TASK_INPUT_DESC, obj({
    "task_id": prop("string", "The task_id of a task started with interactive (or tty) true."),
    "input": prop("string", "What to type, usually ending with \\n. On a tty \\u0003 is Ctrl-C and"
                            " \\u0004 end of input."),
    "wait_for": prop("string", "Return as soon as new output matches this regular expression."),
    "wait_ms": prop("integer", "Wait up to this many milliseconds (default: until the answer"
                               " goes quiet, at most 2000)."),
    "close_stdin": prop("boolean", "Close the task's input after writing (end of file)."),
}, ["task_id"]), notes("Send input to a background task", destructive=True),
      lane=waiting_lane, goes_with=("bash",), hint="type into a task")
def tool_task_input(session, args, ctx):
    """Write to an interactive task's stdin, then answer like task_output."""
    task = find_task(session, args["task_id"])
    if task.stdin == "null":
        raise ToolError(BASH_TASK_NOT_INTERACTIVE, "task %s was not started with interactive:"
                        " true, so its stdin is /dev/null; start the command again with"
                        " bash(interactive=true) (tty=true for a terminal)" % task.id)
    if task.done.is_set():
        raise ToolError(BASH_TASK_NOT_FOUND, "task %s has ended (%s), so it takes no more input;"
                        " read its last output with task_output"
                        % (task.id, task_status(task)[8:]))
    try:
        if args.get("input"):
            task.write(args["input"].encode("utf-8"), time.monotonic() + TASK_INPUT_WAIT_S)
        if args.get("close_stdin"):
            task.close_input()
    # ValueError: the task ended and its pipe closed meanwhile
    except (OSError, ValueError) as e:
        raise ToolError(IO_ERROR, "the input could not be given to task %s: %s" % (task.id, getattr(
            e, "strerror", None) or e))
    await_task(task, ctx, args.get("wait_for") or None, args.get("wait_ms"), settle=True)
    return task_answer(task, session, ctx)


TASK_STOP_DESC = ("Stop (kill) a background bash task: SIGTERM to its whole group, then SIGKILL "
                  "after 5 s; returns its status and what it printed since the last read.")


@tool("task_stop", TASK_STOP_DESC, obj({
    "task_id": prop("string", "The task_id bash returned."),
}, ["task_id"]), notes("Stop a background task", destructive=True), goes_with=("bash",),
      hint="kill a background task")
def tool_task_stop(session, args, ctx):
    """task_stop: kill a task's process group and answer with its last output."""
    task = find_task(session, args["task_id"])
    kill_all([task])
    return task_answer(task, session, ctx)


###############################################################################
# Tools: search ###############################################################
###############################################################################

GREP_MODES = ("files_with_matches", "content", "count")


def grep_spec(pattern, mode, regex=True, ignore_case=False, multiline=False):
    """A search's settings, as sent to helpers. The pattern is compiled there, never in
    this process: a pathological one (160,000 '[') takes its time where it can be killed."""
    check_pattern(pattern, "pattern" if regex else "query", GREP_INVALID_PATTERN)
    return {"pattern": pattern, "regex": regex, "ignore_case": ignore_case, "multiline": multiline,
            "mode": mode, "before": 0, "after": 0}


def grep_job_of(ctx, roots, spec, args=None, no_ignore=False):
    """A grep job for HelperPool.run: roots from search_root, names filtered by the
    tool arguments' include and type (checked here first, so a malformed one is
    reported at once); with no_ignore, what .gitignore ignores is searched too."""
    include, type_name = (args or {}).get("include"), (args or {}).get("type")
    if include:
        check_pattern(include, "include")
    name_filter(include, type_name)
    return {"op": "grep", "policy": policy_spec(ctx.policy), "roots": roots, "spec": spec,
            "include": include, "type": type_name, "no_ignore": bool(no_ignore)}


def format_records(label, records, numbers, breaks=True):
    """grep's lines for one file's records: `path:line:text` for matches, `path-line-text` for
    context, `--` between groups (left out with breaks=False: search_text's plain list)."""
    out = []
    for rec in records:
        if rec is None:
            if breaks:
                out.append("--")
            continue
        k, is_match, text = rec
        sep = ":" if is_match else "-"
        out.append("%s%s%s%s" % (label, sep, ("%d%s" % (k, sep)) if numbers else "", text))
    return out


def cap_lines(lines, what, notice=(), limit=OUTPUT_MAX_CHARS, instead=None):
    """Join output lines within `limit` characters; a cut list starts and ends with
    the line that says what was left out and how to page on (or, for a tool that takes
    no offset, what to do `instead`). The `notice` lines (a partial search's) always
    come last, cut or not."""
    total, kept = sum(len(n) + 1 for n in notice) + 400, []        # 400: room for the two cut lines
    for i, line in enumerate(lines):
        total += len(line) + 1
        if total > limit:
            cut = ("[output truncated at %d characters: %d more %s not shown; %s]" % (
                limit, len(lines) - i, what,
                instead or "narrow the search (path, include, type) or page on with"
                           " head_limit/offset (offset=%d)" % i))
            return "\n".join([cut] + kept + [cut] + list(notice))
        kept.append(line)
    return "\n".join(kept + list(notice))


def paged(items, args, head_limit=None):
    """items[offset:offset + head_limit]: the call's head_limit, else `head_limit`, whose
    cut page ends with a line that says how to page on (0 or None: to the end); past the
    end, a line that says so."""
    offset = args.get("offset") or 0
    limit = args.get("head_limit", head_limit)
    if offset < 0 or (limit is not None and limit < 0):
        raise ToolError(INVALID_INPUT, "offset and head_limit must be 0 or more")
    if offset and offset >= len(items):
        return ["No more results: offset %d is past the end (%d in total)." % (offset, len(items))]
    rest = items[offset:]
    if not limit or len(rest) <= limit or "head_limit" in args:
        return rest[:limit or None]
    return rest[:limit] + ["[%d more not shown; page on with offset=%d]"
                           % (len(rest) - limit, offset + limit)]


def newest_first(found):
    """The paths of (rel, mtime) pairs, newest first, ties by path.
    Two stable C-level sorts: much cheaper than a Python key for 30k paths."""
    found = sorted(found, key=itemgetter(0))
    found.sort(key=itemgetter(1), reverse=True)
    return [rel for rel, _ in found]


def partial_notice(why):
    """The lines a search ends with: none for a whole one, else the one saying it was cut."""
    if not why:
        return []
    if why == "deadline":
        return ["[search %s: the results above are partial. Narrow the path, include or type, or"
                " simplify the pattern (nested quantifiers such as (a+)+ can take forever)]"
                % stopped_why(why)]
    return ["[search cancelled: partial results]"]


GREP_DESC = ("Grep: search file contents for a regex pattern, to find text in files (Python re "
             "syntax; ripgrep-like). Walks `path` skipping .git, node_modules, binary files and "
             "what .gitignore ignores. output_mode: files_with_matches (default; paths, newest "
             "first), content (path:line:text, with optional context lines) or count (path:count). "
             "Filter files with include or type.")
GLOB_DESC = ("Find files by name: list the files matching a glob pattern (**, *, ?, {a,b}, [a-z]); "
             "a pattern without '/' matches file names at any depth, one with '/' whole relative "
             "paths (src/*.c: the direct children of src). Returns paths relative to `path`, "
             "newest first; skips .git, node_modules and .gitignore'd files.")
GREP_PROPS = {
    "pattern": prop("string", "The regular expression to search for."),
    "path": prop("string", "File or directory to search (default: the working directory)."),
    "include": prop("string",
                    "Only search files whose name matches this glob, e.g. *.py or *.{ts,tsx}."),
    "type": prop("string",
                 "Only search files of this language: py, js, ts, go, rust, java, c, cpp, ..."),
    "output_mode": prop("string", "files_with_matches (default), content or count.",
                        enum=list(GREP_MODES)),
    "case_insensitive": prop("boolean", "Ignore case."),
    "line_numbers": prop("boolean", "content mode: show line numbers (default true)."),
    "context_before": prop("integer", "content mode: lines before each match."),
    "context_after": prop("integer", "content mode: lines after each match."),
    "context": prop("integer", "content mode: lines before and after each match."),
    "multiline": prop("boolean", "Let . match newlines and patterns span lines."),
    "head_limit": prop("integer",
                       "Show at most this many lines (content) or entries (other modes)."),
    "offset": prop("integer", "Skip this many lines/entries."),
    "no_ignore": prop("boolean", "Search what .gitignore ignores too."),
}
COMPAT_GREP_NAMES = {"glob": "include", "-i": "case_insensitive", "-n": "line_numbers",
                     "-A": "context_after", "-B": "context_before", "-C": "context"}


def renamed(handler, names):
    """A handler that takes other parameter names and calls `handler` with ours (the
    other name wins where a call gives both)."""
    def call(session, args, ctx):
        ours = {k: v for k, v in args.items() if k not in names}
        ours.update((names[k], v) for k, v in args.items() if k in names)
        return handler(session, ours, ctx)
    return call


def compat_grep_schema(config):
    """grep's schema under --anthropic-compat: Claude Code's names (glob, -i, -n, -A, -B, -C)
    and `context` besides -C (models write either; -C wins when both are given)."""
    back = {v: k for k, v in COMPAT_GREP_NAMES.items()}
    props = {back.get(k, k): v for k, v in GREP_PROPS.items()}
    props["context"] = GREP_PROPS["context"]
    return obj(props, ["pattern"])


@tool("grep", GREP_DESC, obj(GREP_PROPS, ["pattern"]),
      notes("Search file contents", read_only=True), modes=DEFAULT,
      codes={"output_mode": GREP_INVALID_OUTPUT_MODE}, hint="search file contents, regex")
def tool_grep(session, args, ctx):
    """grep: search file contents for a regex, ripgrep style (files, count or content mode),
    in a helper."""
    pattern = args["pattern"]
    # (the schema's enum checked it)
    mode = args.get("output_mode") or "files_with_matches"
    if pattern == "":
        raise ToolError(GREP_INVALID_PATTERN,
                        "pattern is empty; give a regular expression to search for")
    shown = args.get("path") or "."
    root = search_root(session, ctx, shown)
    spec = grep_tool_spec(args, pattern, mode)
    no_ignore = args.get("no_ignore")
    items, why = ctx.helpers.run(grep_job_of(ctx, [root], spec, args, no_ignore), ctx.cancelled)
    hits, unread = grep_hits(items)
    if not hits:
        more = (ignored_matches(ctx, root, shown, spec, args)
                if root.is_dir and not no_ignore and not why else [])
        return "\n".join(["No matches found for pattern %r in %s" % (shorten(pattern), shown)]
                         + partial_notice(why) + more + unread)
    hits = [h if root.is_dir else h._replace(rel=shown) for h in hits]
    return grep_answer(hits, spec, args, partial_notice(why) + unread, search_cap(ctx))


tool("grep", GREP_DESC, compat_grep_schema, notes("Search file contents", read_only=True),
     modes=COMPAT, codes={"output_mode": GREP_INVALID_OUTPUT_MODE},
     hint="search file contents, regex")(
    renamed(tool_grep, COMPAT_GREP_NAMES))


def ignored_matches(ctx, root, shown, spec, args):
    """After a search of a directory found nothing: a line naming how many files that
    .gitignore ignores hold a match, and the argument that searches them (no_ignore);
    none when they hold none either."""
    listing = dict(spec, mode="files_with_matches")
    items, _ = ctx.helpers.run(grep_job_of(ctx, [root], listing, args, True), ctx.cancelled)
    hits = grep_hits(items)[0]
    if not hits:
        return []
    return ["(%s that .gitignore ignores under %s hold%s matches, e.g. %s: pass no_ignore: true"
            " to search them; .git, node_modules and binary files are never searched.)" % (
                plural(len(hits), "file"), shown, "s" if len(hits) == 1 else "", hits[0].rel)]


def grep_hits(items):
    """(GrepHits, the line that ends the answer when some files could not be read: how
    many, and why) of a grep job's items."""
    hits = [GrepHit(*item) for item in items]
    unread = Counter(h.result for h in hits if isinstance(h.result, str))
    if not unread:
        return hits, []
    return ([h for h in hits if not isinstance(h.result, str)],
            ["[skipped %s that could not be read: %s]"
             % (plural(sum(unread.values()), "file"), ", ".join(unread))])


def grep_tool_spec(args, pattern, mode):
    """The grep tool's job spec: context lines (content mode), how many records a file
    may give (what one page can show), and whether the search stops early: a content
    search whose call gives a head_limit ends once it has that many lines, in the order
    the walk finds them (one helper, no sort by path). A page of GREP_HEAD_LIMIT is cut
    from the whole search, sorted, as a page of offset alone is."""
    ctx_n = args.get("context") or 0
    before = args.get("context_before", ctx_n) if mode == "content" else 0
    after = args.get("context_after", ctx_n) if mode == "content" else 0
    if min(before, after) < 0:
        raise ToolError(INVALID_INPUT, "context lines must be 0 or more")
    spec = grep_spec(pattern, mode, True, bool(args.get("case_insensitive")),
                     bool(args.get("multiline")))
    spec.update(before=before, after=after)
    spec["max_records"] = ((args.get("offset") or 0)
                           + (args.get("head_limit", GREP_HEAD_LIMIT) or OUTPUT_MAX_CHARS // 2))
    if mode == "content" and args.get("head_limit"):
        spec["stop_after"] = spec["max_records"]       # the search ends once that many lines are in
    return spec


def grep_answer(hits, spec, args, notice, cap):
    """The grep tool's text for its hits, in its output mode, paged and capped."""
    mode = spec["mode"]
    if mode != "files_with_matches" and not spec.get("stop_after"):
        # (a search that stopped early keeps the order it found)
        hits.sort(key=attrgetter("rel"))
    if mode == "files_with_matches":
        lines = newest_first((h.rel, h.mtime) for h in hits)
    elif mode == "count":
        lines = ["%s:%d" % (h.rel, h.result) for h in hits]
    else:
        lines = grep_lines(hits, args.get("line_numbers", True))
    return cap_lines(paged(lines, args, GREP_HEAD_LIMIT), "lines" if mode == "content"
                     else "files", notice, cap)


def grep_lines(hits, numbers):
    """Content mode's lines: each hit's records, `--` between files and between groups
    that are not adjacent (with or without context lines, as the original boris)."""
    lines = []
    for hit in hits:
        if lines:
            lines.append("--")
        lines += format_records(hit.rel, hit.result, numbers)
    return lines


def glob_plan(pattern):
    """(static directory prefix, pattern rest, match on base name only)."""
    parts = pattern.split("/")
    static = []
    while len(parts) > 1 and not any(ch in parts[0] for ch in "*?[{\\"):
        static.append(parts.pop(0))
    rest = "/".join(parts)
    if rest.startswith("**/") and "/" not in rest[3:]:
        return "/".join(static), rest[3:], True
    return "/".join(static), rest, "/" not in pattern    # 'src/*.c': direct children of src only


def check_glob_pattern(pattern):
    """A glob's pattern (not empty, a valid path), or GLOB_INVALID_PATTERN."""
    if not pattern.strip():
        raise ToolError(GLOB_INVALID_PATTERN, "pattern is empty; give a glob such as **/*.py")
    try:
        PathPolicy.validate(pattern, "pattern")
    except ToolError as e:
        raise ToolError(GLOB_INVALID_PATTERN, e.message)


def find_paths(session, ctx, pattern, shown, kind):
    """The one glob front: ([rel, mtime, rel, mtime, ...], None or why the list is partial)
    under `shown` matching `pattern`; the walk and the matching run in a helper. `kind`:
    'file' (None: files, unless the pattern ends with '/', which means directories) or
    'directory'; with directories, 'dir/**' lists dir itself too (zero or more levels)."""
    check_glob_pattern(pattern)
    if pattern.endswith("/") and pattern.strip("/"):
        if kind == "file":
            raise ToolError(GLOB_INVALID_PATTERN, "pattern %r ends with '/', which matches"
                            " directories only, but type is 'file'; drop the '/' or the type"
                            % shorten(pattern))
        pattern, kind = pattern.rstrip("/"), "directory"
    kind = kind or "file"
    real = resolve_checked(session, ctx, shown)
    prefix, rest, base_only = glob_plan(pattern[1:] if pattern.startswith("/") else pattern)
    if pattern.startswith("/"):
        real = "/"
    try:
        compile_glob(rest)
    except ValueError as e:
        raise ToolError(GLOB_INVALID_PATTERN, "pattern %r is malformed: %s" % (shorten(pattern), e))
    try:
        start = canonical(os.path.join(real, prefix)) if prefix else real
    except OSError:
        return [], None
    if not os.path.isdir(start) or ctx.policy.is_denied(start):
        return [], None
    job = {"op": "glob", "policy": policy_spec(ctx.policy), "start": start, "rest": rest,
           "base_only": base_only, "kind": kind, "lead": len(real) + 1 if real != "/" else 1}
    found, why = ctx.helpers.run(job, ctx.cancelled)
    if kind == "directory" and rest == "**" and prefix:
        # '**' is zero or more directories
        found = [os.path.normpath(prefix), mtime(start)] + found
    return found, why


GLOB_PROPS = {"pattern": prop("string", "The glob pattern, e.g. **/*.py or src/**/*.{ts,tsx}."),
              "path": prop("string", "Directory to search in (default: the working directory)."),
              "head_limit": prop("integer", "Show at most this many paths."),
              "offset": prop("integer", "Skip this many paths.")}


@tool("glob", GLOB_DESC,
      obj(dict(GLOB_PROPS, type=prop("string", "file (default; a pattern ending in / means"
                                               " directory) or directory.",
                                     enum=["file", "directory"])), ["pattern"]),
      notes("Find files by name", read_only=True), modes=DEFAULT, codes={"type": GLOB_INVALID_TYPE},
      hint="find files by name")
@tool("glob", GLOB_DESC, obj(GLOB_PROPS, ["pattern"]), notes("Find files by name", read_only=True),
      modes=COMPAT, hint="find files by name")
def tool_glob(session, args, ctx):
    """glob: paths matching a pattern, newest first, in a helper."""
    found, why = find_paths(session, ctx, args["pattern"], args.get("path") or ".",
                            args.get("type"))
    notice = partial_notice(why)
    if not found:
        return "\n".join(["No files found"] + notice)
    return cap_lines(paged(newest_first(glob_pairs(found)), args), "paths", notice, search_cap(ctx))


@tool("search_text", "Search for text in files: every line containing `query` (literal, or a"
      " regular expression when regex is true) under each of `paths`, as path:line:content."
      " For code, prefer grep.", obj({
          "query": prop("string", "The text (or regex) to find."),
          "paths": prop("array", "Files or directories to search (default: the working directory).",
                        items={"type": "string"}),
          "regex": prop("boolean", "Treat query as a regular expression."),
      }, ["query"]), notes("Search text", read_only=True), hint="search text")
def tool_search_text(session, args, ctx):
    """search_text: the workspace tools' content search (plain text or regex)."""
    query = args["query"]
    if query == "":
        raise ToolError(INVALID_INPUT, "query is empty; give the text to search for")
    spec = grep_spec(query, "content", bool(args.get("regex")))
    shown_paths = args.get("paths") or ["."]
    roots = [search_root(session, ctx, shown) for shown in shown_paths]
    items, why = ctx.helpers.run(grep_job_of(ctx, roots, spec), ctx.cancelled)
    hits, unread = grep_hits(items)
    lines = []
    for hit in sorted(hits, key=lambda h: (h.root, h.rel or "")):
        shown = shown_paths[hit.root]
        label = os.path.join(shown, hit.rel) if roots[hit.root].is_dir else shown
        lines += format_records(label, hit.result, True, breaks=False)
    notice = partial_notice(why) + unread
    if not lines:
        return "\n".join(["No matches found for %r in %s" % (query, ", ".join(shown_paths))]
                         + notice)
    return cap_lines(lines, "lines", notice, search_cap(ctx),
                     instead="narrow the search (a path deeper in `paths`, a longer query), or use"
                             " grep, which pages with head_limit/offset")


@tool("search_files", "Find files whose path matches a glob pattern (e.g. src/**/*.ts or"
      " **/*.md), searched from the working directory; returns one path per line. For code,"
      " prefer glob.", obj({
          "pattern": prop("string", "The glob pattern."),
      }, ["pattern"]), notes("Find files", read_only=True), hint="find files")
def tool_search_files(session, args, ctx):
    """search_files: the workspace tools' name search."""
    found, why = find_paths(session, ctx, args["pattern"], ".", None)
    notice = partial_notice(why)
    if not found:
        return "\n".join(["No files found matching %r" % args["pattern"]] + notice)
    return cap_lines(newest_first(glob_pairs(found)), "paths", notice, search_cap(ctx),
                     instead="narrow the pattern, or use glob, which pages with head_limit/offset")


###############################################################################
# Tools: workspace (fixed Chinese answers) ####################################
###############################################################################
# These answer in fixed Chinese strings (the module header's History says where they
# come from); an answer starting with 错误 is an error. Paths are confined to the
# workspace root (--workdir) by PathPolicy.confine.

OUTSIDE_WORKSPACE_ERROR = "错误：路径越出工作区限制"


def workspace_path(ctx, path):
    """The workspace tools' one resolver: the canonical path inside the workspace root
    (and allow/deny), or their fixed string for an escape and for a path that is not valid
    (NUL byte, too long)."""
    try:
        return ctx.policy.confine(path)
    except ToolError as e:
        if e.code == ACCESS_DENIED:
            raise plain_error(OUTSIDE_WORKSPACE_ERROR, ACCESS_DENIED)
        raise plain_error("错误：路径无效: %s" % e.message, INVALID_INPUT)


def workspace_error(e, path, doing):
    """A shared layer's ToolError in the workspace tools' fixed Chinese words."""
    if e.detail == "directory":
        return plain_error("错误：%s 不是文件" % path, INVALID_INPUT)
    if e.code == PATH_NOT_FOUND:
        return plain_error("错误：文件不存在: %s" % path, e.code)
    if e.detail == "swapped":
        log("warn", "path escape attempt refused (swapped while opening)", path=path)
        return plain_error(OUTSIDE_WORKSPACE_ERROR, e.code)
    if e.code == FILE_TOO_LARGE:
        return plain_error("错误：文件过大: %s（上限 %s）"
                           % (path, human_size(e.detail)), e.code)
    return plain_error("错误：无法%s %s: %s" % (doing, path, e.message), e.code)


def workspace_note(config, prefer):
    """What every workspace tool's description ends with: its paths, its errors, and the tool
    to `prefer` for coding work."""
    return ("Paths: relative to the workspace root %s, never outside. Errors start with 错误."
            " For code, prefer %s." % (config.workdir, prefer))


def workspace_argument_error(e):
    """A refused path argument in the workspace tools' fixed Chinese words."""
    return plain_error("错误：路径无效: %s" % e.message, e.code) if e.detail == "path" else e


READ_FILE_NOTICE_CHARS = 300       # of --max-result-chars: room for read_file's read-on line


def read_file_description(config):
    """read_file's description: how long an answer gets (--max-result-chars, less room for
    the read-on notice) and where its paths go."""
    longest = config.max_result_chars - READ_FILE_NOTICE_CHARS
    return ("Read a text file from the workspace and return its content (a long one up to {:,}"
            " characters, with the offset to read on). ".format(longest)
            + workspace_note(config, "view"))


@tool("read_file", read_file_description, obj({
    "path": prop("string", "File path inside the workspace."),
    "encoding": prop("string", "Text encoding (default utf-8; falls back to latin-1)."),
    "offset": prop("integer", "First line to return, 1-based (default 1)."),
    "limit": prop("integer", "How many lines to return (default: the rest)."),
}, ["path"]), notes("Read file", read_only=True, idempotent=True),
      argument_error=workspace_argument_error, hint="read file")
def tool_read_file(session, args, ctx):
    """read_file: a workspace file's text (from an offset, a limit of lines), in its encoding."""
    path, encoding = args["path"], args.get("encoding") or "utf-8"
    real = workspace_path(ctx, path)
    try:
        data, st = read_regular(real, path, ctx.config.max_file_size)
    except ToolError as e:
        raise workspace_error(e, path, "读取文件")
    codec = text_codec(encoding)
    if codec is None:
        raise plain_error("错误：不支持的编码: %s（请用 utf-8、gbk、latin-1"
                          " 等文本编码 / use a text encoding such as utf-8, gbk or latin-1）"
                          % encoding[:100], INVALID_INPUT)
    session.mark_viewed(real, Seen(st, digest_of(data)) if st is not None else None)
    try:
        text = data.decode(codec)
    except ValueError:                  # (UnicodeError among them)
        try:
            text = data.decode("latin-1")
        except UnicodeError:
            raise plain_error("错误：文件编码无法识别")
    return line_window(text, args.get("offset"), args.get("limit"),
                       ctx.config.max_result_chars - READ_FILE_NOTICE_CHARS)


def lines_within(lines, k, last, cap):
    """(lines[k:last] joined within `cap` characters, the index after the last one
    taken); a first line longer than cap is cut, never left out."""
    out, size, first = [], 0, k
    while k < last and size + len(lines[k]) <= cap:
        out.append(lines[k])
        size += len(lines[k])
        k += 1
    if k == first and k < last:                      # one line longer than the bound
        out.append(lines[k][:cap])
        k += 1
    return "".join(out), k


def line_window(text, offset, limit, cap):
    """Lines offset.. (1-based) of text, at most `limit` of them, the whole within
    `cap` characters; a cut result starts and ends with the offset that reads on."""
    if offset is None and limit is None and len(text) <= cap:
        return text
    lines = text.splitlines(True)
    first = max(1, offset or 1)
    if first > max(1, len(lines)):
        raise plain_error("错误：offset %d 超出文件行数（%d 行）" % (first, len(lines)),
                          INVALID_INPUT)
    last = len(lines) if limit is None else min(len(lines), first - 1 + max(0, limit))
    body, k = lines_within(lines, first - 1, last, cap)
    if k < len(lines):
        notice = ("[已显示第 %d-%d 行，共 %d 行；用 offset=%d 继续读取"
                  " / lines %d-%d of %d shown; read on with offset=%d]"
                  % (first, k, len(lines), k + 1, first, k, len(lines), k + 1))
        return read_on(body.rstrip("\n"), notice)
    return body


@tool("write_file", lambda config: "Write content to a file in the workspace, creating parent"
      " directories; overwrites an existing file. "
      + workspace_note(config, "create_file or str_replace"), obj({
          "path": prop("string", "File path inside the workspace."),
          "content": prop("string", "The complete file content."),
      }, ["path", "content"]), notes("Write file", destructive=True),
      argument_error=workspace_argument_error, hint="write file")
def tool_write_file(session, args, ctx):
    """write_file: write a workspace file whole, its directories made."""
    path, content = args["path"], args["content"]
    real = workspace_path(ctx, path)
    data = encode_text(content)            # (the schema check refused lone surrogates)
    if len(data) > ctx.config.max_file_size:
        raise plain_error("错误：内容过大（%s，上限 %s），未写入: %s" % (
            human_size(len(data)), human_size(ctx.config.max_file_size), path), FILE_TOO_LARGE)
    with ctx.files.lock(real):
        if os.path.isdir(real):
            raise plain_error("错误：%s 是目录" % path, INVALID_INPUT)
        seen = session.seen_of(real)
        change = (seen is not None and os.path.lexists(real)
                  and changed_since(seen, real, ctx.config.max_file_size))
        if change:
            raise plain_error("错误：文件在上次读取后已被修改（%s）："
                              "请先用 read_file 重新读取 %s 再写入"
                              % (change, path), FILE_CHANGED)
        try:
            existing_kind(real, path)                   # refuses FIFOs and devices
            write_edit(session, ctx, "write_file", [FileEdit(real, path, data)])
        except ToolError as e:
            raise workspace_error(e, path, "写入")
    return "成功：已写入 %s" % path


@tool("list_directory", lambda config: "List a workspace directory: one entry per line, [D] for"
      " directories and [F] for files, sorted by name. " + workspace_note(config, "view or glob"),
      obj({
          "path": prop("string", "Directory path inside the workspace (default: the root)."),
      }), notes("List directory", read_only=True, idempotent=True),
      argument_error=workspace_argument_error, hint="list directory")
def tool_list_directory(session, args, ctx):
    """list_directory: a workspace directory's entries, [D] or [F] each."""
    path = args.get("path") or "."
    real = workspace_path(ctx, path)
    try:
        entries = list_entries(real)
    except FileNotFoundError:
        raise plain_error("错误：目录不存在: %s" % path, PATH_NOT_FOUND)
    except NotADirectoryError:
        raise plain_error("错误：%s 不是目录" % path, INVALID_INPUT)
    except OSError as e:
        raise workspace_error(io_error(e, path), path, "列出目录")
    lines = ["[%s] %s" % ("D" if is_dir else "F", name) for name, is_dir, _ in entries
             if not ctx.policy.is_denied(child_prefix(real) + name)]
    if not lines:
        return "(空目录)"
    text = "\n".join(lines)
    cap = ctx.config.max_result_chars - 400
    if len(text) > cap:
        shown = text[:cap].count("\n")
        text = read_on("\n".join(lines[:shown]),
                       "[共 %d 项，只列出前 %d 项；请用 glob 或列出子目录"
                       " / %d entries, the first %d shown; use glob or list a subdirectory]"
                       % (len(lines), shown, len(lines), shown))
    return text


# web_fetch's words for each way a fetch fails (FETCH_ERRORS has the kinds).
_BAD_URL = "错误：无效的网址（%s）: %%(url)s"
WEB_FETCH_WORDS = {
    "content_type": "错误：不支持的内容类型 %(ctype)s: %(url)s",
    "beyond": "错误：start_index %(start)d 超出内容长度（%(length)d 字符）",
    "timeout": "错误：请求超时（%(timeout)ss）: %(url)s",
    "redirect_scheme": "错误：重定向到不支持的协议: %(target)s: %(url)s",
    "unresolved": "错误：无法解析主机 %(host)s: %(url)s",
    "refused": "错误：拒绝连接 %(host)s（%(address)s 是%(why)s）: %(url)s",
    "redirects": "错误：重定向次数过多（超过 %(max)d 次）: %(url)s",
    "status": "错误：HTTP %(status)d: %(url)s",
    "connection_refused": "错误：连接被拒绝: %(url)s",
    "failed": "错误：请求失败（%(reason)s）: %(url)s",
    "scheme": "错误：只支持 http 和 https 网址: %(url)s",
    "url_long": _BAD_URL % "长度 %(length)d 超过 %(max)d 字符 / over %(max)d characters",
    "url_space": _BAD_URL % ("第 %(at)d 个字符是空格或控制字符，"
                             "请用百分号编码（如 %%20）"
                             "/ a space or control character at %(at)d: percent-encode it,"
                             " e.g. %%20"),
    "url_malformed": _BAD_URL % "%(reason)s",
    "url_no_host": _BAD_URL % "没有主机名 / no host name",
    "url_port_zero": _BAD_URL % "端口 0 无效 / port 0 is not a port",
    "url_idna": _BAD_URL % "主机名 %(host)s 无法编码 / the host name cannot be IDNA-encoded",
    "not_allowed": ("错误：%(host)s 不在允许访问的域名之中"
                    "（--web-fetch-allow: %(allowed)s）: %(url)s"),
}


@tool("web_fetch", "Fetch a web page by URL (http, https) and return its readable content: HTML"
      " as light Markdown (no scripts or styles), JSON and plain text as they are; at most {:,}"
      " characters, and a cut page ends with the start_index to read on. Errors start with 错误"
      " (error).".format(WEB_MAX_CHARS), obj({
          "url": prop("string", "The http:// or https:// URL."),
          "timeout": prop("integer", "Seconds the whole fetch may take (default %d, max %d)."
                          % (WEB_TIMEOUT_S, WEB_MAX_TIMEOUT_S)),
          "start_index": prop("integer", "Character offset to read on from."),
      }, ["url"]), notes("Fetch web page", read_only=True, open_world=True),
      argument_error=workspace_argument_error, lane="shell", hint="fetch web page, docs")
def tool_web_fetch(session, args, ctx):
    """web_fetch: a page as light Markdown (or JSON or text), WEB_MAX_CHARS at a time."""
    url, timeout = args["url"], args.get("timeout", WEB_TIMEOUT_S)
    if not 0 < timeout <= WEB_MAX_TIMEOUT_S:
        raise plain_error("错误：timeout 必须在 1 到 %d 秒之间: %s"
                          % (WEB_MAX_TIMEOUT_S, timeout), INVALID_INPUT)
    start = args.get("start_index") or 0
    if start < 0:
        raise plain_error("错误：start_index 不能为负数: %d" % start, INVALID_INPUT)
    try:
        return WebFetch(url, timeout, ctx.cancelled, ctx.config.web_fetch_block_private,
                        ctx.config.web_fetch_allow).text(start)
    except ToolError as e:
        if not isinstance(e.detail, tuple):
            raise
        kind, facts = e.detail
        raise plain_error(WEB_FETCH_WORDS[kind] % facts, e.code)

###############################################################################
# Protocol ####################################################################
###############################################################################

WORKER_IDLE_S = 30.0                       # an idle worker thread retires after this

# The levels logging/setLevel may name (MCP's, after syslog)
MCP_LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
# Arguments clients add to every tool for themselves, dropped unseen (other unknown
# arguments stay errors: they catch typos). Gemini CLI: wait_for_previous.
INJECTED_ARGUMENTS = frozenset(("wait_for_previous",))


def brief(value, most=80):
    """A value as JSON for an error message, at most `most` characters."""
    if isinstance(value, str):
        value = value[:most]
    elif isinstance(value, int) and value.bit_length() > 200:
        return "a %d-bit number" % value.bit_length()
    try:
        return json.dumps(value)[:most]
    except (ValueError, TypeError, RecursionError):
        return type(value).__name__


JSON_TYPES = {"string": lambda v: isinstance(v, str),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool),
              "array": lambda v: isinstance(v, list),
              "object": lambda v: isinstance(v, dict)}


def check_value(name, spec, value, codes=None):
    """Check one argument against its schema: the type, then what every value of that
    type must be (strings are text without NUL or lone surrogates; integers within
    MAX_INT_ARG), the enum (refused with the tool's own code in `codes`, if it has
    one), items and fields."""
    kind = spec.get("type")
    if not JSON_TYPES.get(kind, lambda v: True)(value):
        raise ToolError(INVALID_INPUT, "argument %r must be %s %s, got %s; send it as JSON %s" % (
            name, "an" if kind[0] in "aeiou" else "a", kind, brief(value), kind))
    if kind == "string":
        check_text(name, value)
    elif kind == "integer" and abs(value) > MAX_INT_ARG:
        raise ToolError(INVALID_INPUT, "argument %r is %s, out of range (at most %d either side)"
                        % (name, brief(value), MAX_INT_ARG))
    if "enum" in spec and value not in spec["enum"]:
        raise ToolError((codes or {}).get(name, INVALID_INPUT),
                        "argument %r must be one of %s, got %s"
                        % (name, ", ".join(spec["enum"]), brief(value)))
    lo, hi = spec.get("minItems", 0), spec.get("maxItems")
    if kind == "array" and (len(value) < lo or (hi is not None and len(value) > hi)):
        raise ToolError(INVALID_INPUT, "argument %r must have %s items, got %d" % (
            name, lo if lo == hi else "%d to %s" % (lo, hi), len(value)))
    for k, item in enumerate(value if kind == "array" else ()):
        check_value("%s[%d]" % (name, k), spec.get("items", {}), item)
    if kind == "object" and "properties" in spec:
        check_fields(name + ".", spec, value)


def check_text(name, value):
    """ToolError unless the string argument `name` is text: no NUL, no lone surrogate."""
    if "\x00" in value:
        raise ToolError(INVALID_INPUT, "argument %r contains a NUL character (\\u0000), which"
                        " no path, command or file text may hold" % name, detail=name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ToolError(INVALID_INPUT, "argument %r holds a lone surrogate (%s at character"
                        " %d), which is not Unicode text; send valid UTF-8"
                        % (name, json.dumps(value[e.start]), e.start), detail=name)


def check_fields(prefix, schema, args, codes=None):
    """Unknown, missing and mistyped fields of an object; `prefix` names where it sits."""
    props = schema["properties"]
    for k in args:
        if k not in props:
            raise ToolError(INVALID_INPUT, "unknown argument %r; %s takes: %s"
                            % (prefix + k, "this tool" if not prefix else prefix[:-1],
                               ", ".join(sorted(props))))
    for k in schema.get("required", ()):
        if k not in args:
            raise ToolError(INVALID_INPUT, "missing required argument %r (%s); add it to the call"
                            % (prefix + k, props[k].get("description", "").rstrip(".")))
    for k, v in args.items():
        check_value(prefix + k, props[k], v, codes)


# -- the worker pool --------------------------------------------------------------
class WorkerPool:
    """Threads that run tool calls so the reader never blocks, fair between sessions.

    A call starts at once when its owner (a session's lane: its shell commands, or
    its quick tools) runs fewer than `per_session` calls and the pool fewer than
    `max_workers`; an owner with nothing running always starts its call at once, so
    one busy session never delays another's next call, nor its own quick tools. Other
    calls wait in their owner's own queue, in order, and as calls end the owners take
    turns. A new thread starts whenever none is idle; idle threads retire after
    WORKER_IDLE_S."""

    def __init__(self, max_workers=MAX_WORKERS, per_session=SESSION_MAX_RUNNING):
        self.ready = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = 0
        self.workers = 0
        self.max_workers = max_workers
        self.per_session = per_session
        self.running = {}                       # owner -> calls running
        self.total = 0
        self.waiting = OrderedDict()            # owner -> deque of calls, owners in turn order

    def submit(self, fn, owner=None):
        """Run fn on a worker thread, or queue it (behind the owner's earlier ones) when the
        pool or the owner's share is full."""
        with self.lock:
            if owner in self.waiting or not self._may_start(owner):
                self.waiting.setdefault(owner, deque()).append(fn)
                return
            start = self._admit(owner)
        self._dispatch(fn, owner, start)

    def _may_start(self, owner):
        n = self.running.get(owner, 0)
        return n < self.per_session and (self.total < self.max_workers or n == 0)

    def _admit(self, owner):
        """Count a call as running (lock held); True when it needs a new thread."""
        self.running[owner] = self.running.get(owner, 0) + 1
        self.total += 1
        if self.idle:
            self.idle -= 1
            return False
        self.workers += 1
        return True

    def _dispatch(self, fn, owner, start):
        self.ready.put((fn, owner))
        if start:
            threading.Thread(target=self._run, daemon=True, name="boris-worker").start()

    def _run(self):
        while True:
            try:
                fn, owner = self.ready.get(timeout=WORKER_IDLE_S)
            except queue.Empty:
                with self.lock:
                    if self.idle > 0:
                        self.idle -= 1
                        self.workers -= 1
                        return
                continue
            try:
                fn()
            except Exception:
                log("error", "worker crashed", error=_traceback())
            self._finish(owner)

    def _finish(self, owner):
        """A call ended: admit waiting calls, one owner's at a time in turn."""
        admitted = []
        with self.lock:
            self.running[owner] -= 1
            if not self.running[owner]:
                del self.running[owner]
            self.total -= 1
            self.idle += 1
            progress = True
            while progress:
                progress = False
                for o in list(self.waiting):
                    if not self._may_start(o):
                        continue
                    calls = self.waiting[o]
                    admitted.append((calls.popleft(), o, self._admit(o)))
                    progress = True
                    if calls:
                        self.waiting.move_to_end(o)
                    else:
                        del self.waiting[o]
        for fn, o, start in admitted:
            self._dispatch(fn, o, start)


_LONE_SURROGATE = r"\\\\|\\ud[89ab][0-9a-f]{2}\\ud[c-f][0-9a-f]{2}|\\ud[89a-f][0-9a-f]{2}"


def dump_json(msg):
    """A message as ASCII JSON that strict parsers accept: a lone surrogate (an
    undecodable byte of a file name that slipped through) becomes U+FFFD, and a
    non-finite number (which strict input never brings) null."""
    try:
        text = json.dumps(msg, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(finite(msg), separators=(",", ":"), allow_nan=False)
    if "\\ud" not in text:
        return text
    return re.sub(_LONE_SURROGATE, lambda m: m.group(0) if len(m.group(0)) != 6 else "\\ufffd",
                  text)


def finite(value):
    """`value` with every NaN or infinity inside it replaced by None."""
    if isinstance(value, float):
        return value if value - value == 0 else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def valid_id(value):
    """A JSON-RPC request id this server answers to, or a progress token it sends back as
    it came: a string of valid Unicode or an integer (not a bool, a float, null, a list
    or an object)."""
    if isinstance(value, str):
        return not re.search(_SURROGATES, value)    # a lone surrogate cannot go into JSON
    return isinstance(value, int) and not isinstance(value, bool)


_SURROGATES = "[\ud800-\udfff]"


def scrub(text):
    """Tool output made valid Unicode: undecodable bytes (lone surrogates) become
    U+FFFD, with a note saying so."""
    clean, bad = re.subn(_SURROGATES, "\ufffd", text)
    if not bad:
        return text
    return clean + "\n[%s that are not UTF-8 shown as U+FFFD]" % plural(bad, "byte")


def object_at(msg, key):
    """The member `key` of a message's object when it is an object itself, else {}."""
    value = msg.get(key)
    return value if isinstance(value, dict) else {}


def error_response(rid, code, message, data=None):
    """A JSON-RPC error answer (`data` when given)."""
    err = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return {"jsonrpc": "2.0", "id": rid, "error": err}


def result_response(rid, result):
    """A JSON-RPC result answer."""
    return {"jsonrpc": "2.0", "id": rid, "result": result}


# -- the server -------------------------------------------------------------------
class McpServer:
    """JSON-RPC dispatch for MCP. Knows nothing about stdio or HTTP: a transport hands
    it a message, a session and an `emit(message)` callback (thread-safe), and every
    answer, progress notification included, goes out through `emit`."""

    def __init__(self, config, policy, sandbox=None):
        self.config = config
        self.policy = policy
        self.tools = build_tools(config)
        self.pool = WorkerPool()
        self.sandbox = sandbox if sandbox is not None else resolve_sandbox(config, policy)
        self.proxy = None                      # the sandbox's one door, with a domain list
        if self.sandbox.on and not self.sandbox.network and self.sandbox.domains:
            self.proxy = EgressProxy(self.sandbox.domains)
            self.sandbox.proxy_port = self.proxy.port
        self.helpers = HelperPool(avoid=self.sandbox.writable)
        self.lsp = LangServers(config, policy, self.sandbox)
        self.files = FileGuards()
        # every session's checkpoints keep bytes here
        self.store = Store(config, policy.allow or [policy.workdir])
        self._tool_list = [t.listing(config) for t in self.tools.values()]
        self.answered = threading.Event()      # set once a tool call has been answered

    def close(self):
        """Kill every helper process this server started (sessions close their own), remove
        the checkpoint store."""
        self.helpers.close()
        self.lsp.close()
        self.store.close()
        self.sandbox.close()
        if self.proxy is not None:
            self.proxy.close()

    # -- entry point ---------------------------------------------------------
    def dispatch(self, msg, session, emit):
        """One incoming message, in three steps: its envelope (envelope_check), its
        protocol version (requested_version), then its route: a notification, a tool
        call, or another method (call_method)."""
        session.last_seen = time.monotonic()
        go, refusal = self.envelope_check(msg)
        if not go:
            if refusal is not None:
                emit(refusal)
            return
        method, rid = msg["method"], msg.get("id")
        params = msg.get("params") or {}             # envelope_check let only an object or null by
        if "id" not in msg:
            self.notification(method, params, session)
            return
        modern, refusal = self.requested_version(msg)
        if refusal is not None:
            emit(refusal[1])
        elif method == "tools/call":
            self.call_tool(rid, params, session, emit, modern)
        else:
            self.call_method(rid, method, params, session, emit, modern)

    def call_method(self, rid, method, params, session, emit, modern):
        """A request other than tools/call: its handler's result, or the JSON-RPC error."""
        handler = self.METHODS.get(method)
        if handler is None:
            emit(error_response(rid, -32601, "Method not found: %s" % method))
            return
        try:
            result = handler(self, params, session)
        except RpcError as e:
            emit(error_response(rid, e.code, "Invalid params: %s" % e.message))
            return
        except Exception:
            log("error", "internal error", method=method, error=_traceback())
            emit(error_response(rid, -32603, "Internal error while handling %s" % method))
            return
        if modern is not None:
            result = dict(result, resultType="complete", _meta=dict(
                result.get("_meta") or {}, **{SERVER_INFO_KEY: self.server_info()}))
            if method == "tools/list":
                result.update(cacheScope="private", ttlMs=0)
        emit(result_response(rid, result))

    def notification(self, method, params, session):
        """A notification: a cancel ends the request it names; initialized starts the first
        checkpoint."""
        if method == "notifications/initialized":
            self.checkpoints_of(session).start()
        if method == "notifications/cancelled":
            rid = params.get("requestId")
            if session.cancel(rid):
                log("debug", "request cancelled", id=rid, reason=params.get("reason"))

    # -- methods -------------------------------------------------------------
    def instructions(self):
        """The instructions initialize returns: what the server is, its sandbox, its scope."""
        cfg = self.config
        lines = [INSTRUCTIONS_FIRST_LINE, self.sandbox.describe(),
                 "Working directory: %s" % cfg.workdir]
        # (the Go original's lines, next to each other in its order)
        if self.policy.allow:
            lines.append("Allowed directories: %s" % ", ".join(self.policy.allow))
        if self.policy.deny_raw:
            lines.append("Denied patterns: %s" % ", ".join(self.policy.deny_raw))
        lines.append("View before edit: %s" % ("on" if cfg.require_view_before_edit else "off"))
        if cfg.web_fetch_allow:
            lines.append("web_fetch reaches only: %s" % ", ".join(cfg.web_fetch_allow))
        if cfg.anthropic_compat:
            lines.append("Anthropic compatibility: on (str_replace_editor, Claude Code grep names)")
        if cfg.transport == "http":
            lines.append("State across calls (working directory, viewed files, background tasks)"
                         " is kept per MCP session; requests without a session share the state of"
                         " their bearer token (or of the local user when no token is set). A task"
                         " id is a random handle: keep it.")
        # (each line here rides along with every tool's description in Codex: rules for one tool
        # go in that tool's description)
        lines.append("Prefer the view, grep and glob tools over cat, grep and find in bash: their"
                     " results are bounded and numbered.")
        return "\n".join(lines)

    def server_info(self):
        """serverInfo: name and version."""
        return {"name": SERVER_NAME, "version": __version__}

    def capabilities(self, modern=False):
        """Server capabilities; 2026-07-28 has no logging capability (SEP-2577)."""
        caps = {"tools": {"listChanged": False}}
        return caps if modern else dict(caps, logging={})

    def m_initialize(self, params, session):
        """initialize: the protocol version (the client's if spoken here), capabilities, server
        info, instructions."""
        info = object_at(params, "clientInfo")
        if isinstance(info.get("name"), str):
            session.client = info["name"]
        asked = params.get("protocolVersion")
        version = asked if asked in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[0]
        return {"protocolVersion": version, "capabilities": self.capabilities(),
                "serverInfo": self.server_info(), "instructions": self.instructions()}

    def m_discover(self, params, session):
        """server/discover (the stateless revision): versions, capabilities, info, instructions."""
        return {"supportedVersions": list(SUPPORTED_VERSIONS),
                "capabilities": self.capabilities(modern=True), "serverInfo": self.server_info(),
                "instructions": self.instructions(), "cacheScope": "private", "ttlMs": 0}

    def m_ping(self, params, session):
        """ping: an empty result."""
        return {}

    def m_tools_list(self, params, session):
        """tools/list: every registered tool."""
        return {"tools": self._tool_list}

    def m_set_level(self, params, session):
        """logging/setLevel: from now on the session's client is sent, as notifications/message,
        what this server logs about its calls at `level` or above (a tool that crashed)."""
        level = params.get("level")
        if level not in MCP_LOG_LEVELS:
            raise RpcError(-32602, "level must be one of %s, not %s"
                           % (", ".join(MCP_LOG_LEVELS), brief(level)))
        session.log_level = level
        return {}

    @staticmethod
    def tell(session, emit, level, message, **fields):
        """Log a call's event on stderr, and to the session's client as notifications/message
        when it asked for `level` (an MCP level) or below with logging/setLevel."""
        log({"warning": "warn"}.get(level, level), message, **fields)
        wanted = session.log_level
        if wanted is not None and MCP_LOG_LEVELS.index(level) >= MCP_LOG_LEVELS.index(wanted):
            emit({"jsonrpc": "2.0", "method": "notifications/message",
                  "params": {"level": level, "logger": SERVER_NAME,
                             "data": dict(fields, message=message)}})

    METHODS = {"initialize": m_initialize, "server/discover": m_discover, "ping": m_ping,
               "tools/list": m_tools_list, "logging/setLevel": m_set_level}

    # -- tools/call ----------------------------------------------------------
    def call_tool(self, rid, params, session, emit, modern):
        """tools/call: check the tool and its arguments, then run it on a worker (its answer comes
        through emit)."""
        name = params.get("name")
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            emit(error_response(rid, -32602, "Invalid params: unknown tool %r; available: %s"
                                % (name, ", ".join(self.tools))))
            return
        args = params.get("arguments")
        cancelled = session.begin(rid)
        meta = object_at(params, "_meta")
        token = meta.get("progressToken")
        progress = self.progress_sender(token, emit) if valid_id(token) else None
        ctx = CallContext(self.config, self.policy, cancelled, progress, self.helpers,
                          self.client_name(meta, session), self.sandbox, self.files, self.lsp)

        def run():
            # made here too: a client may skip notifications/initialized, and checkpoints and
            # rewind read them
            checkpoints = self.checkpoints_of(session)
            try:
                note = (checkpoints.before(call_summary(name, args), cancelled)
                        if tool.changes else None)
                # cancelled while it waited: it never ran, nobody reads this
                if note is CANCELLED_BEFORE:
                    result = {"content": [text_block("cancelled before it ran")], "isError": True}
                else:
                    try:
                        result = self.run_tool(tool, session, args, ctx)
                    finally:
                        if tool.changes:
                            checkpoints.after()
                    if note:
                        result["content"].append(text_block(note))
                if modern is not None:
                    result.update(resultType="complete",
                                  _meta={SERVER_INFO_KEY: self.server_info()})
                response = result_response(rid, result)
            except Exception:
                log("error", "tool crashed", tool=name, error=_traceback())
                self.tell(session, emit, "error",
                          "tool crashed; its traceback is in the server's log", tool=name)
                response = error_response(rid, -32603, "Internal error in tool %s" % name)
            try:
                if not cancelled.is_set():
                    emit(response)
            finally:
                # after emit: a transport waiting on inflight sees the answer first
                session.end(rid, cancelled)
                self.answered.set()
        lane = tool.lane
        if callable(lane):
            lane = lane(args if isinstance(args, dict) else {})
        self.pool.submit(run, owner=(session, lane))

    def checkpoints_of(self, session):
        """The session's Checkpoints of the workspace roots (--allow-dir, else --workdir), made on
        first use."""
        with session.lock:
            if session.checkpoints is None:
                busy = lambda: session.busy() or \
                    time.monotonic() < session.ended + CHECKPOINT_CALM_S
                session.checkpoints = Checkpoints(self.policy.allow or [self.policy.workdir],
                                                  self.policy, self.config, busy, self.store)
            return session.checkpoints

    @staticmethod
    def run_tool(tool, session, args, ctx):
        """Check the arguments, call the handler and shape its answer as a CallToolResult."""
        try:
            try:
                if args is None:                         # null means 'not given'
                    args = {}
                if not isinstance(args, dict):
                    raise ToolError(INVALID_INPUT,
                                    "arguments must be a JSON object of argument names and values")
                props = tool.schema["properties"]
                checked = {k: v for k, v in args.items()
                               if v is not None and (k in props or k not in INJECTED_ARGUMENTS)}
                check_fields("", tool.schema, checked, tool.codes)
            except ToolError as e:
                raise tool.argument_error(e)
            out = tool.handler(session, checked, ctx)
        except (ImportError, OSError, RecursionError, ToolError) as e:
            error = e if isinstance(e, ToolError) else lacking(e)   # a lack: said, never a crash
            return {"content": [text_block(scrub(error.render()))], "isError": True}
        if isinstance(out, str):
            out = [text_block(out)]
        cap = ctx.config.max_result_chars
        for block in out:
            if block.get("type") == "text":
                block["text"] = scrub(block["text"])
                # a tool's own bound failed: still never longer
                if len(block["text"]) > cap:
                    notice = ("[result cut at %d of %d characters: ask for less (view_range,"
                              " offset/limit, head_limit)]" % (cap - 300, len(block["text"])))
                    block["text"] = read_on(block["text"][:cap - 300], notice)
        return {"content": out, "isError": False}

    @staticmethod
    def client_name(meta, session):
        """Who is calling: the name in the request's _meta clientInfo (2026-07-28 clients such
        as Claude Code send it there, never in initialize), else initialize's."""
        info = object_at(meta, CLIENT_INFO_KEY)
        if isinstance(info.get("name"), str) and valid_id(info["name"]):
            return info["name"]
        return session.client

    @staticmethod
    def progress_sender(token, emit):
        """A progress callback that sends notifications/progress with `token`."""
        counter = [0]

        def progress(text):
            counter[0] += 1
            emit({"jsonrpc": "2.0", "method": "notifications/progress",
                  "params": {"progressToken": token, "progress": counter[0], "message": text}})
        return progress

    @staticmethod
    def envelope_check(msg):
        """A message's JSON-RPC envelope: (True, None) to go on; (False, an error answer)
        for an invalid one; (False, None) for one to drop (a response to us, a notification
        with bad params)."""
        if not isinstance(msg, dict):
            batch = " (batches are not supported)" if isinstance(msg, list) else ""
            return False, error_response(None, -32600,
                                         "Invalid Request: expected a JSON-RPC object" + batch)
        method, rid, has_id = msg.get("method"), msg.get("id"), "id" in msg
        if method is None and ("result" in msg or "error" in msg):
            return False, None                          # a response to us: we send no requests
        id_ok = not has_id or valid_id(rid)
        if msg.get("jsonrpc") != "2.0" or not isinstance(method, str) or not id_ok:
            return False, error_response(rid if id_ok else None, -32600,
                                         "Invalid Request: need jsonrpc '2.0', a string method and"
                                         " a string (valid Unicode) or integer id")
        params = msg.get("params")
        if params is None or isinstance(params, dict):
            return True, None
        return False, (error_response(rid, -32602, "params must be an object") if has_id else None)

    def requested_version(self, msg):
        """(the stateless revision a request names in its _meta, None for a request of the
        session-based ones; (HTTP status, error answer) when the revision refuses it, else
        None). A 2026-07-28 request (or server/discover) carries _meta with the protocol
        version and the client's capabilities (-32602), names a version spoken here
        (-32022, with the one list of supported versions), and a method the revision has
        (-32601: unknown, or one it removed, answered 404 over HTTP)."""
        rid, method, params = msg.get("id"), msg.get("method"), msg.get("params") or {}
        meta = object_at(params, "_meta")
        invalid = lambda why: (400, error_response(rid, -32602, "Invalid params: " + why))
        if META_VERSION_KEY not in meta:
            if method != "server/discover":
                return None, None
            return None, invalid("server/discover carries _meta with %s and %s"
                                 % (META_VERSION_KEY, CLIENT_CAPS_KEY))
        modern = meta[META_VERSION_KEY]
        if modern not in MODERN_VERSIONS:
            return None, (400, error_response(
                rid, UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version", {
                    "supported": list(SUPPORTED_VERSIONS),
                    "requested": modern[:100] if isinstance(modern, str) else brief(modern)}))
        if not isinstance(meta.get(CLIENT_CAPS_KEY), dict):
            return modern, invalid("_meta lacks %s (an object)" % CLIENT_CAPS_KEY)
        if meta.get(LOG_LEVEL_KEY, "info") not in MCP_LOG_LEVELS:       # (none given: fine)
            return modern, invalid("%s must be one of %s, not %s" % (
                LOG_LEVEL_KEY, ", ".join(MCP_LOG_LEVELS), brief(meta[LOG_LEVEL_KEY])))
        if method in REMOVED_METHODS or method != "tools/call" and method not in self.METHODS:
            return modern, (404, error_response(rid, -32601, "Method not found: %s (protocol %s)"
                                                % (method, modern)))
        if method == "tools/list" and params.get("cursor") is not None:
            return modern, invalid("cursor %s was never given (tools/list has one page)"
                                   % brief(params["cursor"]))
        return modern, None

###############################################################################
# Transports ##################################################################
###############################################################################


class Stopper:
    """How the process is told to stop: by a signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT)
    or by a transport (stdin EOF). Signal handlers only note the reason and write a
    byte to a pipe; they never raise or take a lock, so no signal is lost whatever
    the main thread is doing, and a repeated one during shutdown changes nothing.
    The main thread owns shutdown: it waits here, then cleans up."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

    def __init__(self):
        self.reason = None
        self.r, self.w = os.pipe()
        os.set_blocking(self.w, False)

    def stop(self, reason):
        """Ask the server to stop (from a signal handler too), saying why."""
        if self.reason is None:
            self.reason = reason
        try:
            os.write(self.w, b"!")
        except OSError:                  # pipe full: a wakeup is already pending
            pass

    def install(self):
        """Route the shutdown signals here (main thread only). The wakeup fd matters: a
        signal may land on any thread, and only the C handler runs there; it writes
        to the pipe, which wakes the main thread to run the Python handler."""
        for sig in self.SIGNALS:
            signal.signal(sig, lambda signum, frame: self.stop(signal.Signals(signum).name))
        signal.set_wakeup_fd(self.w, warn_on_full_buffer=False)

    def wait(self):
        """Block until stopped."""
        while self.reason is None:
            # a shutdown signal's number in the wakeup pipe stops the server here, even when
            # the main thread (where its Python handler runs) is not running Python code
            if ready([self.r], 1.0):
                for number in bytearray(os.read(self.r, 512)):
                    if number in self.SIGNALS:
                        self.stop(signal.Signals(number).name)


def _no_constant(name):
    raise ValueError("%s is not a JSON number (non-finite numbers are refused)" % name)


def _finite_float(text):
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError("the number %s is out of range (non-finite numbers are refused)"
                         % text[:40])
    return value


def _bounded_int(text):
    # int() of a huge literal is quadratic and holds the GIL
    if len(text) > 1000:
        raise ValueError("an integer of %d digits is out of range" % len(text))
    return int(text)


def parse_message(raw):
    """One JSON-RPC message from bytes; ValueError for anything that is not strict
    JSON: NaN, Infinity and numbers that overflow to them (1e400) are refused, as is
    an integer of over 1,000 digits, and any nesting too deep to parse."""
    hooks = {"parse_constant": _no_constant, "parse_float": _finite_float,
             "parse_int": _bounded_int}
    try:
        try:
            # bytes as they are: no decoded copy of a big line
            return json.loads(raw, **hooks)
        except UnicodeDecodeError:
            return json.loads(raw.decode("utf-8", "replace"), **hooks)
    except RecursionError:
        raise ValueError("nesting too deep")


def serve_stdio(server, session, stopper, stdin_fd=0, stdout=None):
    """One JSON message per line on stdin/stdout; only protocol on stdout. Returns
    when stdin ends or `stopper` is told to stop, after closing the session."""
    stdout = stdout or sys.stdout.buffer
    lock = threading.Lock()
    broken = threading.Event()

    def emit(msg):
        data = (dump_json(msg) + "\n").encode("ascii")         # one line of ASCII JSON
        with lock:
            if broken.is_set():
                return
            try:
                stdout.write(data)
                stdout.flush()
            except (OSError, ValueError):
                broken.set()
                stopper.stop("stdout closed")

    def on_line(line):
        if line is None:
            emit(error_response(None, -32700, "Parse error: line over %d bytes" % STDIO_MAX_LINE))
            return
        if not line.strip():
            return
        try:
            msg = parse_message(line)
        except ValueError as e:
            emit(error_response(None, -32700, "Parse error: %s" % e))
            return
        try:
            server.dispatch(msg, session, emit)
        except Exception:
            log("error", "internal error", error=_traceback())
            emit(error_response(None, -32603, "Internal error"))

    def reader():
        # Raw reads: no buffered-stdin lock left held at exit. A line over STDIO_MAX_LINE
        # comes as None (answered as a parse error and skipped).
        lines = LineBuffer(STDIO_MAX_LINE)
        while True:
            try:
                chunk = os.read(stdin_fd, 1 << 16)
            except InterruptedError:
                continue  # a signal: read again
            except OSError:
                break  # stdin is gone: end of input
            if not chunk:
                if lines.rest().strip():
                    on_line(lines.rest())
                break
            for line in lines.feed(chunk):
                on_line(line)
        stopper.stop("eof")

    threading.Thread(target=reader, daemon=True).start()
    stopper.wait()
    if stopper.reason == "eof":
        session.settle()                # (answered before the session is closed)
    else:
        log("info", "shutting down", reason=stopper.reason)
    session.close()


# -- streamable HTTP ----------------------------------------------------------
# http.server, hmac and socket are imported inside these methods: stdio never pays.
# HttpTransport.bind mixes McpHttpServer into http.server's ThreadingHTTPServer and
# McpRequestHandler into its BaseHTTPRequestHandler.

class McpHttpServer:
    """The transport's side of http.server's ThreadingHTTPServer, mixed into it by
    HttpTransport.bind (which sets `transport` and `address_family` on the class):
    connections capped (the one waiting longest for a request makes room, else a 503),
    a dropped client a debug line rather than a traceback."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128        # the default 5 resets bursts of new clients

    def process_request(self, request, client_address):
        if not self.transport.slots.acquire(blocking=False) and not self.transport.make_room():
            # 503; then what the client has sent is read and dropped (briefly: this is the
            # accept thread), since a socket closed with unread input is reset, and a reset
            # can destroy the answer before the client reads it.
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\n"
                                b"Content-Type: application/json\r\n"
                                b"Content-Length: 27\r\nConnection: close\r\n\r\n"
                                b"{\"error\": \"server is busy\"}")
                request.shutdown(1)                 # (SHUT_WR: the answer is all)
                request.settimeout(0.05)
                for _ in range(16):
                    if not request.recv(65536):
                        break
            except OSError:
                pass  # the client went away, or sends on: it is closed now either way
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.transport.slots.release()

    def handle_error(self, request, client_address):
        e = sys.exc_info()[1]           # one line (a dropped client is normal), never a traceback
        if isinstance(e, OSError):                 # (ConnectionError and TimeoutError are ones)
            log("debug", "http connection ended", client=str(client_address[0]),
                reason=type(e).__name__)
        else:
            log("error", "http handler failed", client=str(client_address[0]), error=_traceback())


class McpRequestHandler:
    """The MCP endpoint's request handling, mixed into http.server's
    BaseHTTPRequestHandler by HttpTransport.bind (imported only when HTTP is
    served): do_GET, do_POST and do_DELETE check the request (guarded), read it,
    pick its session and answer it, in JSON or as an SSE stream."""

    transport = None            # the HttpTransport: bind sets it on the class, with the timeout
    GONE = object()                            # next_out(): the client went away
    NOT_MCP = {"error": "not found", "detail": "the MCP endpoint is /mcp"}
    CORS_METHODS = "GET, POST, DELETE, OPTIONS"
    CORS_HEADERS = ("Authorization, Content-Type, Accept, Mcp-Session-Id, Mcp-Protocol-Version,"
                    " Last-Event-ID")
    protocol_version = "HTTP/1.1"
    server_version = "boris/" + __version__
    sys_version = ""

    def setup(self):
        import socket
        super().setup()
        # Headers and body go out as separate writes: without this, Nagle holds the
        # body until the client's delayed ACK, 40 ms on every reply.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):
        log("debug", "http " + (fmt % args))

    def handle_one_request(self):
        self.transport.waiting(self.connection, True)
        try:
            super().handle_one_request()
        finally:
            self.transport.waiting(self.connection, False)

    def parse_request(self):
        ok = super().parse_request()                        # reads the headers
        self.transport.waiting(self.connection, False)      # they are in: a request, not a wait
        return ok

    def end_headers(self):
        """Every reply to a request from an admitted Origin (loopback, any port) carries
        the CORS headers, so a browser-based client on another local port can read it."""
        # none yet when the request line was bad
        headers = getattr(self, "headers", None)
        origin = headers.get("Origin") if headers is not None else None
        if origin and is_loopback(host_of(origin)):
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Expose-Headers",
                             "Mcp-Session-Id, Mcp-Protocol-Version")
            self.send_header("Vary", "Origin")
        super().end_headers()

    def reply(self, code, body=None, headers=(), close=False):
        """Send a JSON (or empty) reply. close=True ends the connection after it, which is
        how every early refusal makes sure an unread body is never taken as a request."""
        data = b"" if body is None else dump_json(body).encode("ascii")
        self.send_response(code)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if data:
            self.wfile.write(data)

    def refuse(self, code, body, headers=()):
        """Reply `code` and close the connection (None, for `return self.refuse(...)`)."""
        self.reply(code, body, headers, close=True)

    def body_length(self):
        """The Content-Length, within HTTP_MAX_BODY; None once a refusal is sent."""
        raw_length = self.headers.get("Content-Length", "").strip()
        if not raw_length:
            return self.refuse(411, {"error": "Content-Length required"})
        if not raw_length.isdigit():
            return self.refuse(400, {"error": "invalid Content-Length %r" % raw_length[:40]})
        if int(raw_length) > HTTP_MAX_BODY:
            return self.refuse(413, {"error": "body over %d bytes" % HTTP_MAX_BODY})
        return int(raw_length)

    def origin_ok(self):
        """Whether the request's Origin (if any) is a loopback one; None once the 403 is sent."""
        origin = self.headers.get("Origin")
        if origin is not None and not is_loopback(host_of(origin)):
            return self.refuse(403, {"error": "forbidden",
                                     "detail": "Origin %s is not allowed" % origin})
        return True

    def guarded(self):
        """Path, Origin, Host and bearer checks: True, or None once a refusal is sent."""
        # OAuth discovery: none here, say so at once
        if self.path.startswith("/.well-known/"):
            return self.refuse(404, {"error": "not found",
                                     "detail": "no OAuth here: this server expects a static"
                                               " bearer token (Authorization: Bearer <token>, see"
                                               " --token)"})
        if self.path.split("?", 1)[0].rstrip("/") != "/mcp":
            return self.refuse(404, self.NOT_MCP)
        if not self.origin_ok():
            return False
        if (self.transport.local_bind
                and not is_loopback(host_of(self.headers.get("Host", "localhost")))):
            return self.refuse(403, {"error": "forbidden",
                                     "detail": "Host header is not a local address"})
        if not self.bearer_ok():
            return self.refuse(401, {"error": "unauthorized",
                                     "detail": "this server expects a static bearer token: send"
                                               " 'Authorization: Bearer <token>' with the token"
                                               " given to boris by --token or printed by"
                                               " --generate-token; it does not do OAuth"},
                               [("WWW-Authenticate", 'Bearer realm="boris"')])
        return True

    def bearer_ok(self):
        """Whether the request carries the bearer token (compared in constant time), or
        none is required."""
        import hmac
        token = self.transport.token
        return not token or hmac.compare_digest(self.bearer(), token.encode())

    def bearer(self):
        """The token the Authorization header carries, as bytes (b"" for none)."""
        auth = self.headers.get("Authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        return given.encode("utf-8", "replace")

    def read_body(self):
        """The POST body as a one-element list holding the parsed JSON value (which may
        itself be null), or None once a refusal is sent."""
        ctype = self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            return self.refuse(415, {"error": "Content-Type must be application/json"})
        length = self.body_length()
        if length is None:
            return None
        raw = self.rfile.read(length)
        if len(raw) < length:
            self.close_connection = True
            return None
        try:
            return [parse_message(raw)]
        except ValueError as e:
            self.reply(400, error_response(None, -32700, "Parse error: %s" % e))
            return None

    def pick_session(self, msg):
        """(session, new id or None) of a message whose id, if any, is valid (do_POST);
        (None, None) after a refusal was sent."""
        t = self.transport
        meta = object_at(object_at(msg, "params"), "_meta")
        rid = msg.get("id")
        header = self.headers.get("MCP-Protocol-Version")
        if META_VERSION_KEY not in meta and header and header not in SUPPORTED_VERSIONS:
            self.reply(400, error_response(rid, -32600, "Unsupported protocol version: the"
                                           " MCP-Protocol-Version header says %r." % header))
            return None, None
        modern, refusal = t.server.requested_version(msg) if "id" in msg else (None, None)
        # (a header that disagrees comes first)
        if "id" in msg and META_VERSION_KEY in meta:
            refusal = self.header_mismatch(msg, meta, rid) or refusal
        if refusal is not None:
            self.reply(*refusal)
            return None, None
        if modern:
            # (stateless: a session id is no state)
            return t.principal_session(self.principal()), None
        sid = self.headers.get("Mcp-Session-Id")
        if msg.get("method") == "initialize" and "id" in msg:
            sid = t.new_session()
            return t.get_session(sid), sid
        if sid:
            session = t.get_session(sid)
            if session is None:
                self.reply(404, error_response(rid, -32001, "Session not found: it ended or never"
                                                            " existed; initialize again"))
            return session, None
        if META_VERSION_KEY in meta or msg.get("method") == "server/discover":
            return t.principal_session(self.principal()), None
        self.reply(400, error_response(rid, -32600, "Bad Request: the Mcp-Session-Id header is"
                                       " missing; initialize first, then send the id it gave."))
        return None, None

    def header_mismatch(self, msg, meta, rid):
        """(400, a HeaderMismatch answer) when a 2026-07-28 request's headers disagree with its
        body: MCP-Protocol-Version with _meta's, Mcp-Method with its method (required), Mcp-Name
        with the tool it calls (required when it names one); values compared exactly, a
        =?base64?...?= value decoded first. None when they agree."""
        import base64
        name = object_at(msg, "params").get("name") if msg.get("method") == "tools/call" else None
        mirrors = (("MCP-Protocol-Version", "protocol version", meta.get(META_VERSION_KEY)),
                   ("Mcp-Method", "method", msg.get("method")), ("Mcp-Name", "tool name", name))
        for header, what, body in mirrors:
            value = self.headers.get(header)
            if value is not None:
                value = value.strip(" \t")                # (HTTP's optional whitespace)
                if value.startswith("=?base64?") and value.endswith("?="):
                    try:
                        value = base64.b64decode(value[9:-2], validate=True).decode("utf-8")
                    except (ValueError, UnicodeError):
                        pass                              # (compared, and quoted, as it came)
            if body is None or value == body or header == "MCP-Protocol-Version" and value is None:
                continue
            if header != "MCP-Protocol-Version" and not isinstance(meta.get(META_VERSION_KEY), str):
                # (a request of no version spoken here: -32022 says so)
                continue
            said = "is missing" if value is None else "says " + brief(value)
            return 400, error_response(rid, HEADER_MISMATCH, "Header mismatch: the body's %s is %s,"
                                       " but the %s header %s." % (what, brief(body), header, said))
        return None

    def principal(self):
        """Who sent a request, for state without a session: the bearer token it proved
        (by a digest, never the token itself), or the local user when none is required."""
        if not self.transport.token:
            return "local user"
        import hashlib
        return "token " + hashlib.sha256(self.bearer()).hexdigest()[:16]

    def client_gone(self):
        """Whether the client closed its end (checked without blocking)."""
        import socket
        try:
            return (bool(ready([self.connection], 0))
                    and self.connection.recv(1, socket.MSG_PEEK) == b"")
        except (OSError, ValueError):
            return True  # a socket that errors is a client that is gone

    def start_stream(self, headers):
        """Start an SSE reply (text/event-stream; the connection closes after it)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        # (a proxy such as nginx passes each event on at once)
        self.send_header("X-Accel-Buffering", "no")
        self.send_header("Connection", "close")
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.close_connection = True

    def answer(self, msg, session, sid):
        """Dispatch one request; reply with JSON, or with an SSE stream once a progress
        notification arrives before the result."""
        rid = msg["id"]
        box = queue.Queue()
        self.transport.server.dispatch(msg, session, box.put)
        streaming = False
        headers = [("Mcp-Session-Id", sid)] if sid else []
        while True:
            out = self.next_out(box, session, rid)
            if out is self.GONE:
                return
            # out is None: the call was cancelled
            final = out is None or (out.get("id") == rid and ("result" in out or "error" in out))
            if not streaming:
                if final:
                    self.reply(204 if out is None else 200, out, headers)
                    return
                self.start_stream(headers)
                streaming = True
            if not self.send_event(out, session, rid) or final:
                return

    def next_out(self, box, session, rid):
        """The next message for request rid: a progress notification, its answer, None
        when it was cancelled (no answer comes), or GONE when the client left (then
        the request is cancelled)."""
        while True:
            try:
                return box.get(timeout=0.25)
            except queue.Empty:
                if self.client_gone():
                    session.cancel(rid)
                    self.close_connection = True
                    return self.GONE
                if not session.is_inflight(rid) and box.empty():
                    return None

    def send_event(self, out, session, rid):
        """Send one SSE event (none for None); False when the client is gone."""
        try:
            if out is not None:
                self.wfile.write(("event: message\ndata: %s\n\n" % dump_json(out)).encode("ascii"))
                self.wfile.flush()
            return True
        except OSError:
            session.cancel(rid)
            return False

    def do_GET(self):
        """GET /health answers; GET /mcp is refused (no unsolicited messages are sent)."""
        if self.path.split("?", 1)[0] == "/health":
            self.reply(200, {"status": "ok", "name": SERVER_NAME, "version": __version__,
                                "sessions": len(self.transport.sessions)})
        elif self.guarded():
            self.refuse(405, {"error": "method not allowed",
                              "detail": "this server sends no unsolicited messages; POST requests"
                                        " to /mcp"}, [("Allow", "POST, DELETE")])

    def do_OPTIONS(self):
        """A browser's CORS preflight of /mcp or /health: 204 with what may be sent, before
        authentication (a preflight carries no credentials); a foreign Origin gets 403."""
        if self.path.split("?", 1)[0].rstrip("/") not in ("/mcp", "/health"):
            self.refuse(404, self.NOT_MCP)
        elif self.origin_ok():
            self.reply(204, None, [("Access-Control-Allow-Methods", self.CORS_METHODS),
                                   ("Access-Control-Allow-Headers", self.CORS_HEADERS),
                                   ("Access-Control-Max-Age", "600"),
                                   ("Allow", self.CORS_METHODS)])

    def do_DELETE(self):
        """DELETE /mcp ends the session the Mcp-Session-Id header names."""
        if not self.guarded():
            return
        sid = self.headers.get("Mcp-Session-Id")
        if not sid:
            self.refuse(400, {"error": "missing Mcp-Session-Id header"})
        elif self.transport.end_session(sid):
            self.reply(204)
        else:
            self.refuse(404, {"error": "unknown or ended session"})

    def do_POST(self):
        """POST /mcp: one JSON-RPC message; a request gets its answer, a notification 202."""
        if not self.guarded():
            return
        body = self.read_body()
        if body is None:
            return
        msg = body[0]
        if not isinstance(msg, dict):
            self.reply(400, error_response(None, -32600,
                                           "Invalid Request: expected one JSON-RPC object"))
            return
        if "id" in msg and not valid_id(msg["id"]):
            self.reply(400, error_response(None, -32600, "Invalid Request: the id must be a"
                                                         " string (valid Unicode) or an integer"))
            return
        session, sid = self.pick_session(msg)
        if session is None:
            return
        if "id" not in msg or "method" not in msg:
            self.transport.server.dispatch(msg, session, lambda m: None)
            self.reply(202)
            return
        self.answer(msg, session, sid)


class HttpTransport:
    """Streamable HTTP on /mcp (POST, GET -> 405, DELETE) and GET /health.

    Sessions are keyed by an unguessable Mcp-Session-Id; each owns its cwd, viewed set
    and tasks. Requests of the stateless 2026-07-28 revision (protocol version in
    _meta) need no session: their state belongs to their principal (the bearer token,
    or the local user without one), whose task ids are random handles. Knows nothing
    about tools."""

    def __init__(self, server, config, token=None):
        self.server, self.config, self.token = server, config, token
        self.sessions = {}
        self.lock = threading.Lock()
        self.closing = 0                # sessions out of the table whose close has not finished
        self.closed = threading.Condition(self.lock)
        self.idle_s = HTTP_SESSION_IDLE_S
        self.principals = {}            # who -> Session: the state of requests without a session
        self.local_bind = is_loopback(host_of(config.host))
        self.httpd = None
        self.stopping = threading.Event()
        self.slots = threading.BoundedSemaphore(HTTP_MAX_CONNECTIONS)
        # connection -> when it started waiting for a request's headers
        self.idle = {}

    # -- connections -----------------------------------------------------------
    def waiting(self, conn, yes):
        """Note whether `conn` is waiting for the headers of a request."""
        with self.lock:
            if yes:
                self.idle[conn] = time.monotonic()
            else:
                self.idle.pop(conn, None)

    def make_room(self):
        """At the connection cap: end the connection that has waited longest for a
        request (a half-open one, typically), so a new client is served, not refused.
        True once a slot is free."""
        with self.lock:
            oldest = min(self.idle, key=self.idle.get) if self.idle else None
            self.idle.pop(oldest, None)
        if oldest is not None:
            try:
                oldest.shutdown(2)
            except OSError:
                pass  # already closed
        return self.slots.acquire(timeout=1.0)

    # -- sessions ------------------------------------------------------------
    def new_session(self):
        """Make a session; its id (unguessable)."""
        import secrets
        sid = secrets.token_hex(32)
        with self.lock:
            self.sessions[sid] = Session(self.config)
        return sid

    def principal_session(self, who):
        """The state of `who`'s requests that carry no session (2026-07-28 has none):
        one per principal, made on first use and kept until the server stops."""
        with self.lock:
            session = self.principals.get(who)
            if session is None:
                session = self.principals[who] = Session(self.config)
        return session

    def get_session(self, sid):
        """The session with id sid, or None."""
        with self.lock:
            return self.sessions.get(sid)

    def end_session(self, sid):
        """End session sid (its tasks killed); whether there was one. Until its close
        has finished it counts as closing, so that a shutdown meanwhile waits for it."""
        with self.lock:
            session = self.sessions.pop(sid, None)
            if session is None:
                return False
            self.closing += 1
        try:
            session.close()
        finally:
            with self.lock:
                self.closing -= 1
                self.closed.notify_all()
        return True

    def reap_idle(self):
        """End sessions idle longer than the idle limit with nothing running."""
        now = time.monotonic()
        with self.lock:
            stale = [sid for sid, s in self.sessions.items()
                     if now - s.last_seen > self.idle_s and not s.busy()]
        for sid in stale:
            log("info", "closing idle HTTP session", session=sid[:8])
            self.end_session(sid)

    def _reaper(self):
        while not self.stopping.wait(min(1.0, max(0.05, self.idle_s / 4))):
            self.reap_idle()

    def close_all(self):
        """End every session (at shutdown)."""
        with self.lock:
            sids = list(self.sessions)
        for sid in sids:
            self.end_session(sid)
        with self.lock:
            principals = list(self.principals.values())
            self.principals.clear()
        for session in principals:
            session.close()
        with self.lock:                 # a DELETE or the idle reaper may still be closing one
            self.closed.wait_for(lambda: not self.closing, KILL_GRACE_S + 5)

    # -- serving -------------------------------------------------------------
    def bind(self):
        """Listen on the configured address (an McpHttpServer, whose handler is McpRequestHandler
        with this transport); (host, port, ...) as bound."""
        import socket
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        handler = type("Handler", (McpRequestHandler, BaseHTTPRequestHandler),
                       {"transport": self, "timeout": HTTP_READ_TIMEOUT_S})
        server = type("Server", (McpHttpServer, ThreadingHTTPServer),
                      {"transport": self, "address_family": family})
        self.httpd = server((self.config.host, self.config.port), handler)
        threading.Thread(target=self._reaper, daemon=True).start()
        return self.httpd.server_address

    def serve(self):
        """Serve until shutdown(), then end every session."""
        try:
            self.httpd.serve_forever(poll_interval=0.2)
        finally:
            self.stopping.set()
            self.close_all()
            self.httpd.server_close()

    def shutdown(self):
        """Stop serving (from another thread)."""
        self.stopping.set()
        if self.httpd is not None:
            self.httpd.shutdown()


def serve_http(server, config, stop):
    """Serve until `stop` is set; 0, or 2 when the port cannot be had."""
    token = config.token or None
    if config.generate_token:
        import secrets
        token = secrets.token_hex(32)
        sys.stderr.write("bearer token: %s\n" % token)
        sys.stderr.flush()
    transport = HttpTransport(server, config, token)
    try:
        host, port = transport.bind()[:2]
    except OSError as e:
        sys.stderr.write("boris: error: cannot listen on %s:%s: %s\n"
                         % (config.host, config.port, e.strerror or e))
        return 2
    if not token:
        log("warn", "HTTP without a bearer token: any local process can use these tools;"
                    " pass --token or --generate-token to require one")
    log("info", "serving MCP over HTTP", url="http://%s:%d/mcp" % (config.host, port),
        auth=bool(token))
    log("info", server.sandbox.describe(), why=server.sandbox.why)
    # stores that killed servers left; after the lines above
    sweep_stores()
    thread = threading.Thread(target=transport.serve, daemon=True)
    thread.start()
    stop.wait()
    log("info", "shutting down")
    transport.shutdown()
    thread.join(2 * KILL_GRACE_S + 10)         # close_all: its own closes, then any still under way
    return 0


###############################################################################
# main ########################################################################
###############################################################################


def helper_main(args):
    """Entry point of `boris.py --helper KIND [PARENT_PID [...]]`: serve stdin, exit 0
    (2 for no such kind). The sandbox launcher takes SPEC and the command after the
    parent, and becomes the command."""
    kind, parent = (list(args) + ["", ""])[:2]      # (those missing: "")
    seal_memory()                       # a helper (a launcher too) holds the server's environment
    if kind == "sandbox" and len(args) > 3:
        if len(args) == 4 and args[2].startswith("@"):
            return helper_warm_launcher(int(args[2][1:]), args[3])
        return helper_sandbox(args[2], args[3:])
    if kind == "probe" and len(args) == 4:
        return helper_probe(args[2], args[3])
    if kind != "search":
        sys.stderr.write("boris: error: unknown helper kind %r\n" % kind)
        return 2
    guard_helper(int(parent) if parent.isdigit() else None)
    trim_memory()                       # (a helper that compiled this file: the compiler's pages)
    helper_search()
    return 0


def check_main(config, policy, sandbox):
    """--check: what this place gives a server of these flags, a row a part, each part tried
    rather than assumed (the sandbox by probe_sandbox's writes and connect, the search
    helpers by a glob), printed; the exit code."""
    import shutil
    server = McpServer(config, policy, sandbox)
    roots = policy.allow or [policy.workdir]
    session = Session(config)
    try:
        ctx = CallContext(config, policy, helpers=server.helpers, sandbox=sandbox)
        glob = McpServer.run_tool(server.tools["glob"], session,
                                  {"pattern": "*", "path": roots[0]}, ctx)
        servers = ["%s: %s (%s)" % (lang, " ".join(argv), run_program(
            argv[:1] + ["--version"], "/", 10)[1].decode("utf-8", "replace").strip().partition(
                "\n")[0] or "its version unknown")
            for lang in LSP_LANGUAGES for argv in [server.lsp.command(lang)] if argv]
    finally:
        session.close()
        server.close()
    store, inotify = store_place(roots), Watches().open()
    checkpoints_on = config.checkpoint_budget != 0
    rows = [("boris.py", "%s, Python %s, uid %d"
             % (__version__, sys.version.split()[0], os.getuid()))] + sandbox_rows(sandbox) + [
            ("checkpoints", "a private store in %s" % store if store and checkpoints_on else
             "off: " + (NO_STORE if checkpoints_on else "--checkpoint-budget off")),
            ("search helpers", glob["content"][0]["text"] if glob["isError"]
             else "started (a glob answered)"),
            ("inotify", "yes" if inotify is not None else "no: repeated searches stat the tree"),
            ("git", shutil.which("git")
             or "not found: checkpoints keep every file's bytes themselves"),
            ("shell", SHELL),
            ("lsp", "; ".join(servers) or ("off" if "off" in config.lsp else
                                            "none found on PATH (--lsp names one)")),
            ("ssl", "yes" if importable("ssl") else "no: web_fetch cannot fetch https"),
            ("ctypes", "yes" if importable("ctypes") else "no: no sandbox, no inotify; commands may"
             " read the server's environment, and daemons they leave run on")]
    if inotify is not None:
        os.close(inotify)
    sys.stdout.write("".join("%-15s %s\n" % row for row in rows))
    return 0


def sandbox_rows(sandbox):
    """--check's rows of the sandbox: what it is, what its trials proved, what the kernel
    gives it."""
    trials = sandbox.trials
    userns = "yes" if trials.get("a write to a protected .git", "done") != "done" else "not tried"
    if sandbox.on and not sandbox.protect.enforced:
        userns = "no: " + sandbox.protect.why
    return [("sandbox", sandbox.describe().partition(": ")[2]
             + ("" if sandbox.on else "; why: " + sandbox.why)),
            ("  proven", "; ".join("%s: %s" % (k, v if v == "done" else "refused (%s)" % v)
                                   for k, v in sorted(trials.items()))
             or "nothing tried (it is off)"),
            ("  kernel", "Landlock ABI %d; seccomp filters %s; user namespaces %s" % (
                landlock_abi(), "yes" if net_filter_available() else "no", userns))]


def main(argv=None, after_the_script=False):
    """Run the server (or a helper, with --helper): parse the flags, resolve the sandbox, serve
    stdio or HTTP until stopped; the exit code. With after_the_script (run as a script) it serves
    from a thread of its own once start-up is done and returns None (serve_after_the_script)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--helper"]:
        return helper_main(argv[1:])
    if sys.getfilesystemencoding().lower().replace("-", "") != "utf8" and __name__ == "__main__":
        # An ASCII locale (LC_ALL=C) would make every non-ASCII path or command fail:
        # run again in Python's UTF-8 mode, before anything is read.
        os.execv(sys.executable, [sys.executable, "-X", "utf8", THIS_FILE] + argv)
    try:
        config = parse_config(argv, os.environ)
        disabled_tools(config)                    # an unknown --disable-tools name stops start-up
        try:
            policy = PathPolicy.of(config)
        except ValueError as e:
            raise ConfigError("invalid --deny-dir pattern: %s" % e)
        _log_state["level"] = _LOG_LEVELS[config.log_level]
        _log_state["format"] = config.log_format
        sandbox = resolve_sandbox(config, policy)
    except ConfigError as e:
        sys.stderr.write("boris: error: %s\n" % e)
        return 2
    if config.check:
        return check_main(config, policy, sandbox)
    limit_malloc_arenas(1)
    seal_memory()           # the variables kept from commands stay out of /proc/<pid>/environ too
    scrub_environ_block()   # ... and out of a child's, between its fork and its exec
    stopper = Stopper()
    stopper.install()
    # every child of this process is spawn()'s: reaping steals nothing
    _children.wanted = True
    if os.getpid() == 1:
        # PID 1 reaps orphans from the start; others on their first spawn
        start_reaper()
    server = McpServer(config, policy, sandbox)
    server.store.check()
    lacks = missing_modules()
    if lacks:
        log("warn", "this Python was built without %s: what needs them answers an error naming the"
            " module or is off (ssl: https fetches; ctypes: the sandbox, inotify, the server's"
            " environment kept from commands, the daemons they leave ended; zlib: compressed"
            " documents)" % ", ".join(lacks))

    def serve():
        try:
            # booting while the client shakes hands: ready for the first search
            server.helpers.prime()
            if config.transport == "http":
                return serve_http(server, config, stopper)
            log("info", "serving MCP on stdio: waiting for a client's messages on stdin",
                workdir=config.workdir, sandbox=sandbox.mode if sandbox.on else "off")
            log("info", sandbox.describe(), why=sandbox.why)
            # (after the start-up lines, which a user or a script reads first)
            sweep_stores()
            serve_stdio(server, Session(config), stopper)
            return 0
        finally:
            server.close()
            reap_all()
    if not after_the_script or (3, 12, 0) <= sys.version_info[:3] < (3, 12, 2):
        # Python 3.12.0 and 3.12.1 refuse new threads and forks once the main thread is in
        # the interpreter's shutdown (gh-113964): there the server keeps the parse tree.
        return serve()
    serve_after_the_script(serve, server)
    return None


def serve_after_the_script(serve, server):
    """Serve from a thread of its own and let the script's top level end once start-up is over
    (the first tool call answered, or a second passed). CPython keeps the whole parse tree of
    the script it runs (about 25 MB for this file) until the script's top level returns;
    ending it frees the tree, and give_back_memory returns those pages to the system. The
    main thread then waits for this thread in the interpreter's shutdown, still taking
    signals (the Stopper reads them from its wakeup pipe too); the process ends with serve's
    exit code once it has cleaned up."""
    def run():
        code = 1
        try:
            code = serve()
        except BaseException:
            log("error", "the server stopped on an error", error=_traceback())
        finally:
            for f in (sys.stdout, sys.stderr):
                try:
                    f.flush()
                except (OSError, ValueError):
                    pass  # a closed pipe: nothing left to say on it
            os._exit(code if isinstance(code, int) else 0)
    threading.Thread(target=run, name="boris-serve").start()
    threading.Thread(target=give_back_memory, args=(threading.main_thread(),), daemon=True,
                     name="boris-memory").start()
    # the tree is freed after the first tool call (or a second): off its path
    server.answered.wait(1.0)


if __name__ == "__main__":
    _code = main(after_the_script=True)
    if _code is not None:
        sys.exit(_code)
