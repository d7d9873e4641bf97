#!/bin/bash
# nvImageCodec against nvJPEG on the current code, interleaved: each block through
# ../2026-12-06b/call_a.sh into its own folder, all tarred into $OUT/all.tgz.
# efe = efe5475 (main's code); head+3 = the tree with --prepare-threads 3.
A=docs/data/2026-12-06b/call_a.sh; O=$OUT
run() { mkdir -p $O/$1; OUT=$O/$1 EXTRA="$2" ORDER="$3" bash $A 2>&1 | grep -E "^row|featpool"; }
run a "" "efe"
run b "--decoder nvimgcodec" "head+3"
run c "--decoder nvimgcodec --gil-switch-interval-ms 0.2" "head+3"
run d "" "efe"
run e "--decoder nvimgcodec" "head+2"
cd $O && tar czf all.tgz a b c d e && rm -rf a b c d e; date -u
