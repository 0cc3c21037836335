# The in-sandbox half of a SWE-ReX shell session on dsec (session.py has the whole design). Each call is
# one short exec of this script; the shell it starts outlives them all. (The exec that starts it must
# end by itself: the daemon kills a cancelled exec's whole cgroup, which the shell is in.)
#
#   bash driver DIR start LINE                 set DIR up, start the shell, send it LINE (then follow 0)
#   bash driver DIR run OFFSET MARK TOKEN [DONE_TOKEN...]
#                                              stdin: a command. Check its syntax, have the shell source
#                                              it (as TOKEN), follow the output
#   bash driver DIR raw OFFSET MARK            stdin: lines for whatever reads the shell's input; follow
#   bash driver DIR intr OFFSET MARK           SIGINT the shell's foreground, follow
#   bash driver DIR follow OFFSET              follow the output from the log's byte OFFSET
#   bash driver DIR signal INT|KILL            INT: SIGINT the foreground; KILL: SIGKILL what outlived
#                                              SIGINT there, then SIGINT again
#   bash driver DIR alive                      exit status 0 while the shell runs
#   bash driver DIR close                      hang up the shell and its process group, remove DIR
#
# OFFSET is how far the client has read the log; MARK ("-": none) the prompt its last match ended with:
# when the log still ends with it, nothing came after, and the log is emptied before the shell writes more.
#
# Following writes one header line to stdout, "dsec-swerex at N" (N: the log offset the data starts at),
# then the log's bytes as the shell writes them, in at most READS reads (so at most 4 MiB). Its last line
# on stderr says why it stopped: "dsec-swerex more N" (READS reached: follow again from offset N),
# "dsec-swerex gone" (the shell has exited), "dsec-swerex broken" (tail stopped by itself). Instead of "at", run's header may be
# "dsec-swerex syntax RC" followed by bash -n's complaint, and any header "dsec-swerex gone".

set -u
D=$1
mode=$2
shift 2
LOG=$D/log
FIFO=$D/in
READS=512
hp=$(cat "$D/pid" 2>/dev/null) || hp=

alive() { # the shell runs (an exited one may linger as a zombie until its new parent reaps it)
    local stat
    [ -n "$hp" ] && read -r stat <"/proc/$hp/stat" 2>/dev/null || return 1
    stat=${stat##*) }
    [ "${stat%% *}" != Z ]
}

resume() { # OFFSET MARK: sets $at
    local size
    size=$(wc -c <"$LOG") || exit 3
    if [ "$size" -le "$1" ] || { [ "$2" != - ] && [ "$(tail -c "${#2}" "$LOG")" = "$2" ]; }; then
        : >"$LOG"
        at=0
    else
        at=$1
    fi
}

send() { # each argument is one line for the shell's input
    local line first=1
    for line; do
        # bash reads its input in blocks, so a second line already waiting would be read by bash
        # itself, not by the program the first line starts (a terminal hands over one line per read)
        [ "$first" = 1 ] || sleep 0.05
        first=0
        # read-write: opening a FIFO that way never blocks, even when no shell is reading any more
        printf '%s\n' "$line" 1<>"$FIFO" || exit 3
    done
}

follow() {
    local tp wp copied
    printf 'dsec-swerex at %d\n' "$at"
    # tail polls: overlayfs is not a file system GNU tail trusts inotify on, and the default is 1 s
    exec 3< <(exec tail -c "+$((at + 1))" -s 0.01 -f "$LOG" 2>/dev/null)
    tp=$!
    (
        while alive; do sleep 0.5; done
        sleep 0.3 # what the shell wrote last reaches tail first
        kill "$tp" 2>/dev/null
    ) </dev/null >/dev/null 2>&1 &
    wp=$!
    # dd writes each read as it comes (head would hold it in its stdio buffer), READS of them at most
    # (whatever each holds); its statistics say how many bytes that was
    LC_ALL=C dd bs=8192 count="$READS" <&3 2>"$D/dd.$$"
    copied=$(tail -n 1 "$D/dd.$$")
    copied=${copied%% *}
    rm -f "$D/dd.$$"
    if ! alive; then
        echo 'dsec-swerex gone' >&2
    elif kill -0 "$tp" 2>/dev/null && [[ $copied =~ ^[0-9]+$ ]]; then
        echo "dsec-swerex more $((at + copied))" >&2
    else
        echo 'dsec-swerex broken' >&2
    fi
    kill "$tp" "$wp" 2>/dev/null
    return 0
}

kill_foreground() { # SIGKILL the shell's process group but the shell and what ignores SIGINT
    local stat pid fields state ppid pgrp key value ign
    for stat in /proc/[0-9]*/stat; do
        pid=${stat#/proc/}
        pid=${pid%/stat}
        [ "$pid" != "$hp" ] || continue
        read -r fields <"$stat" 2>/dev/null || continue
        # the command name (in parentheses) may hold anything: the fields after it are state ppid pgrp
        read -r state ppid pgrp _ <<<"${fields##*) }"
        [ "$pgrp" = "$hp" ] || continue
        ign=0
        while read -r key value; do
            [ "$key" = SigIgn: ] && ign=$value
        done <"/proc/$pid/status" 2>/dev/null
        # background jobs (cmd &) ignore SIGINT in a shell without job control: they are left running
        if (((16#$ign & 2) == 0)); then kill -KILL "$pid" 2>/dev/null; fi
    done
}

interrupt() { # INT | KILL
    alive || return 0
    if [ "$1" = KILL ]; then kill_foreground; fi
    kill -INT -- "-$hp" 2>/dev/null
    return 0
}

start() { # LINE
    mkdir -p "$D" && rm -f "$FIFO" && mkfifo -m 600 "$FIFO" && : >"$LOG" || exit 3
    # held open from before the shell is forked until LINE is in: a FIFO nobody has open drops its data
    exec 4<>"$FIFO"
    # job control here puts the shell in a process group of its own, which a signal for its
    # foreground then goes to (as a terminal's ^C goes to the foreground's group)
    set -m
    # no rc files: LINE reads them with stdin from /dev/null, so none of their commands can read LINE
    # or what comes after it. stderr starts out as /dev/null so that bash's complaint about job control
    # without a terminal goes nowhere; LINE's first command points it at the log.
    bash --noediting --norc -i <&4 4<&- >>"$LOG" 2>/dev/null &
    hp=$!
    set +m
    echo "$hp" >"$D/pid"
    send "exec 2>>$LOG; $1"
}

run() { # OFFSET MARK TOKEN [DONE_TOKEN...]; stdin: the command
    local offset=$1 mark=$2 token=$3 done rc
    shift 3
    if ! alive; then
        echo 'dsec-swerex gone'
        return 0
    fi
    for done; do rm -f "$D/cmd.$done"; done
    cat >"$D/cmd.$token" || exit 3
    bash -n <"$D/cmd.$token" 2>"$D/syntax" >/dev/null
    rc=$?
    if [ "$rc" != 0 ]; then
        printf 'dsec-swerex syntax %d\n' "$rc"
        cat "$D/syntax"
        rm -f "$D/cmd.$token"
        return 0
    fi
    resume "$offset" "$mark"
    # __dsec_tok names the command in the prompt that follows it (session.py's PS1); __dsec_ret (from the
    # first line) gives the command the $? the previous one left, which the assignment would reset
    send "__dsec_st=\$? __dsec_tok=$token; __dsec_ret \$__dsec_st; source $D/cmd.$token"
    follow
}

raw() { # OFFSET MARK; stdin: lines
    local lines
    mapfile -t lines
    [ "${#lines[@]}" -gt 0 ] || lines=("")
    if ! alive; then
        echo 'dsec-swerex gone'
        return 0
    fi
    resume "$1" "$2"
    send "${lines[@]}"
    follow
}

close() {
    if alive; then
        kill -HUP -- "-$hp" 2>/dev/null
        for _ in 1 2 3 4 5 6 7 8 9 10; do
            alive || break
            sleep 0.05
        done
        kill -KILL "$hp" 2>/dev/null
    fi
    rm -rf "$D"
}

case $mode in
start) start "$1" ;;
run) run "$@" ;;
raw) raw "$@" ;;
intr)
    if ! alive; then
        echo 'dsec-swerex gone'
        exit 0
    fi
    resume "$1" "$2"
    interrupt INT
    follow
    ;;
follow)
    at=$1
    follow
    ;;
signal) interrupt "$1" ;;
alive) alive ;;
close) close ;;
*)
    echo "dsec-swerex: unknown mode $mode" >&2
    exit 2
    ;;
esac
