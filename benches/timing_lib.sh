# Shared by the CPU benchmarks (source it): step times from the verbose timing line, and the
# median of numbers on stdin.
# The timing lines after the first window: mean per-step total (data + forward/backward +
# exposed reduction + optimizer), then the forward/backward and exposed-reduction parts.
step_ms() {
  grep -h 'Timing per step' "$@" | awk -F'|' 'NR>1 {
    for (i=1;i<=4;i++) { split($i, a, " "); for (j=1;j<=length(a);j++) if (a[j]=="ms") v[i]=a[j-1] }
    s+=v[1]+v[2]+v[3]+v[4]; c+=v[2]; r+=v[3]; n++ }
    END { if (n) printf "%.0f %.0f %.0f\n", s/n, c/n, r/n; else print "nan nan nan" }'
}
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
# The median tokens/s of a run's metrics.jsonl ($1) over its steps from $2 on (the first ones
# carry start-up).
median_tps() {
  python3 -c 'import json,statistics,sys
r=[json.loads(l) for l in open(sys.argv[1])]
print(round(statistics.median(x["tokens_per_s"] for x in r if x["step"]>=int(sys.argv[2]))))' "$1" "$2"
}
