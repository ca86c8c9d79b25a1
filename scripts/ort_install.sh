# Install onnxruntime-gpu on the GPU machine from the parts scripts/ort_parts.py cut (.whl/ort-part-K-of-N),
# carried over consecutive device calls while the machine stays warm. From the checkout root:
#     source scripts/ort_install.sh
# Each call copies the parts it carried to /tmp/ort-parts (kept while the machine is warm); once all N are there
# it joins them, unpacks the tree into /tmp/ortsite (xz checks the stream's integrity) and puts that first on
# PYTHONPATH. Later calls while warm need no part: sourcing it again only sets PYTHONPATH.
ort_parts=/tmp/ort-parts
ort_site=/tmp/ortsite
mkdir -p "$ort_parts"
for ort_f in .whl/ort-part-*-of-*; do
  [ -s "$ort_f" ] && cp "$ort_f" "$ort_parts/"
done
if [ ! -e "$ort_site/.ort-ok" ]; then
  ort_n=$(ls "$ort_parts" | sed -n 's/^ort-part-[0-9]*-of-\([0-9]*\)$/\1/p' | head -n 1)
  ort_have=$(ls "$ort_parts" | grep -c "^ort-part-[0-9]*-of-${ort_n:-x}$")
  if [ -n "$ort_n" ] && [ "$ort_have" = "$ort_n" ]; then
    rm -rf "$ort_site" && mkdir -p "$ort_site"
    if for k in $(seq 1 "$ort_n"); do cat "$ort_parts/ort-part-$k-of-$ort_n"; done | xz -dc | tar -xf - -C "$ort_site"
    then touch "$ort_site/.ort-ok" && rm -rf "$ort_parts"
    else echo "ort: the joined parts did not unpack (a part from another prepare?); carry all $ort_n again"
         rm -rf "$ort_parts" "$ort_site"
    fi
  fi
fi
if [ -e "$ort_site/.ort-ok" ]; then
  export PYTHONPATH="$ort_site${PYTHONPATH:+:$PYTHONPATH}"
  echo "ort: onnxruntime-gpu ready in $ort_site"
else
  echo "ort: have ${ort_have:-0} of ${ort_n:-?} parts in $ort_parts (carry the others in the next call)"
fi
