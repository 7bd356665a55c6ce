# Shared by the bench scripts: `source "$(dirname "$0")/lib.sh"` (bash, set -euo pipefail).

# The release build of the load tool, wherever cargo puts it (CARGO_TARGET_DIR honoured).
TOLLGATE_BIN="${CARGO_TARGET_DIR:-target}/release/tollgate"

# needs PACKAGE COMMAND...: exits the script, naming the Debian package to install, if any
# COMMAND is missing (a fresh Debian 12 machine has no valgrind, no redis-tools).
needs() {
  local package=$1 cmd
  shift
  for cmd in "$@"; do
    command -v "$cmd" >/dev/null 2>&1 || {
      echo "$0: needs $cmd (apt-get install -y $package)" >&2
      exit 1
    }
  done
}

# port_is_free PORT: exits the script if something already answers on PORT. redis-server
# --daemonize exits 0 even when it cannot listen, so a script that went on would drive, flush
# and shut down somebody else's server.
port_is_free() {
  if redis-cli -p "$1" ping >/dev/null 2>&1; then
    echo "$0: port $1 already answers; not touching that server (set PORT to a free port)" >&2
    exit 1
  fi
}

# start_redis PORT DIR: a fresh loopback redis-server on a free PORT (persistence off, files in
# DIR), checked to be the one this call started (its process id against its pidfile).
start_redis() {
  local port=$1 dir=$2 pid
  port_is_free "$port"
  mkdir -p "$dir"
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
    --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
  for _ in $(seq 50); do
    if pid=$(redis-cli -p "$port" info server 2>/dev/null | tr -d '\r' | sed -n 's/^process_id://p') \
      && [ -n "$pid" ] && [ -f "$dir/redis.pid" ] && [ "$pid" = "$(cat "$dir/redis.pid")" ]; then
      return 0
    fi
    sleep 0.1
  done
  echo "$0: the redis-server started on port $port did not answer (log: $dir/redis.log)" >&2
  exit 1
}

# load_figure WHO EXPR: reads what `tollgate load --json` printed on stdin (other lines around
# the JSON allowed) and prints the Python expression EXPR over its summary `d` (and `text`, all
# that was read). Fails loudly, naming WHO, when the run had errors (requests that got no
# decision) or its rate was withheld (decisions the store did not make): such a run's figures
# do not measure decisions, and a ratio built on them would hide that.
load_figure() {
  python3 -c "
import json, sys
who, expr = sys.argv[1], sys.argv[2]
text = sys.stdin.read()
try:
    d = json.loads(text[text.index('{'):text.rindex('}') + 1])
except ValueError:
    sys.exit('%s: no summary from tollgate load: %s' % (who, text.strip()[-2000:]))
if d['errors'] or d.get('decisions_per_sec') is None:
    sys.exit('%s: %d of %d requests got no decision (first error: %s)%s; no figure from this run'
             % (who, d['errors'], d['requests'], d.get('first_error'),
                '; rate withheld: %s' % d['rate_withheld'] if d.get('rate_withheld') else ''))
print(eval(expr))" "$1" "$2"
}
