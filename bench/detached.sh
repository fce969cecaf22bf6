#!/usr/bin/env bash
# A job longer than one device call: started detached in one call, waited for in the next ones.
#
#   bash bench/detached.sh start NAME COMMAND...   # returns at once; COMMAND runs on, its output in DIR/NAME.log
#   bash bench/detached.sh wait NAME [SECONDS]     # until it ends or SECONDS pass (default 580): prints the log's
#                                                  # last lines; exit 0 once it ended (its status in DIR/NAME.rc),
#                                                  # 3 while it still runs
#
# DIR is $DETACHED_DIR (default /tmp/detached). A device call lasts at most 10 minutes, but a process started in
# its own session keeps running between calls while the machine is held, so a 13-minute measurement is one start
# and two waits, back to back (the machine is given back after half a minute without a call).
set -uo pipefail
dir=${DETACHED_DIR:-/tmp/detached}
usage="usage: bash bench/detached.sh start NAME COMMAND... | wait NAME [SECONDS]"
action=${1:?$usage}
name=${2:?$usage}
shift 2
mkdir -p "$dir"
log="$dir/$name.log"
case $action in
  start)
    [ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
    if [ -f "$dir/$name.pid" ] && kill -0 "$(cat "$dir/$name.pid")" 2> /dev/null; then
      echo "$name is already running (pid $(cat "$dir/$name.pid"))" >&2
      exit 2
    fi
    rm -f "$dir/$name.rc"
    # its own session: the call's end does not take it down; the exit status written when it ends
    setsid nohup bash -c '"$@"; echo $? > "$0"' "$dir/$name.rc" "$@" > "$log" 2>&1 < /dev/null &
    echo $! > "$dir/$name.pid"
    echo "started $name (pid $!), output in $log"
    ;;
  wait)
    seconds=${1:-580}
    [ -f "$dir/$name.pid" ] || { echo "no job named $name in $dir" >&2; exit 2; }
    end=$((SECONDS + seconds))
    while [ ! -f "$dir/$name.rc" ] && [ $SECONDS -lt $end ]; do sleep 2; done
    tail -n 40 "$log"
    if [ -f "$dir/$name.rc" ]; then
      echo "== $name ended with exit code $(cat "$dir/$name.rc")"
      exit 0
    fi
    echo "== $name still running after ${seconds} s: wait again"
    exit 3
    ;;
  *)
    echo "$usage" >&2
    exit 2
    ;;
esac
