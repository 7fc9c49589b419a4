#!/bin/sh
# The system libraries tandem's Python packages load (Mooncake's store.so: libibverbs,
# librdmacm, libnuma, even over TCP). Installs the missing ones with apt-get when root;
# otherwise prints one line naming what to install. Run by `make install`.
missing=""
for pair in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1; do
    lib=${pair%%:*}
    ldconfig -p | grep -q "$lib" || missing="$missing ${pair#*:}"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing system libraries:$missing"
    apt-get install -y -q $missing >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q $missing >/dev/null; }
else
    echo "make install: Mooncake (KV_STORE=mooncake) needs these system packages; install them:$missing (e.g. sudo apt-get install -y$missing)" >&2
fi
