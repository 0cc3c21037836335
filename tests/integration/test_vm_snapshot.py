"""pack_diff of VMs: the same changes made in a container, a micro-VM and a full VM pack into layers that
give the same file system, whichever kind then runs the new image."""

from __future__ import annotations

import secrets

import dsec

from .conftest import Daemon, require_kind

# Creates, modifies, chowns, links, deletes a file of a lower layer (whiteout), and replaces a lower
# directory with a new one of the same name (opaque directory).
CHANGES = """
set -e
mkdir -p /work/sub
echo result > /work/sub/answer.txt
chmod 640 /work/sub/answer.txt
chown 65534:65534 /work/sub/answer.txt
ln -s sub/answer.txt /work/link
ln /work/sub/answer.txt /work/hard
echo changed > /etc/hostname
rm /etc/group
rm -rf /var/tmp && mkdir -m 700 /var/tmp && echo fresh > /var/tmp/only
"""
# What must come out the same: names, types, modes, owners and contents of what changed.
SURVEY = (
    "cd /; for p in work work/sub work/sub/answer.txt work/link work/hard etc/hostname etc/group var/tmp "
    "var/tmp/only; do if [ -e $p ] || [ -L $p ]; then stat -c '%n %F %a %u:%g %h' $p; else echo \"$p absent\"; fi; "
    "done; cat /work/sub/answer.txt /etc/hostname; ls -a /var/tmp; readlink /work/link"
)


def test_a_vm_packs_the_same_layer_as_a_container(daemon: Daemon) -> None:
    client = daemon.client()
    tag = secrets.token_hex(4)
    surveys: dict[str, str] = {}
    made: list[dsec.Sandbox] = []
    try:
        for kind in ("container", "microvm", "vm"):
            require_kind(client, kind)
            sb = dsec.Sandbox.create(image="dsec/busybox", kind=kind, client=client, memory="192Mi")
            made.append(sb)
            res = sb.exec(CHANGES)
            assert res.exit_code == 0, res.stderr
            before = sb.exec(SURVEY).stdout
            image = sb.snapshot(f"test/vm-pack-{kind}:{tag}", scrub_defaults=False)  # keep /var/tmp
            assert image.layers[-1].role == "diff"
            assert sb.exec("cat /work/sub/answer.txt").stdout == "result\n"  # runs on after the pack
            sb.kill()
            # the new image, run as a container: exactly what the sandbox saw before the pack
            with dsec.Sandbox.create(image=image.name, client=client) as box:
                surveys[kind] = box.exec(SURVEY).stdout
            assert surveys[kind] == before, kind
        assert surveys["microvm"] == surveys["container"] == surveys["vm"]
        assert "etc/group absent" in surveys["microvm"] and "\nonly\n" in surveys["microvm"]
        assert "work/sub/answer.txt regular file 640 65534:65534 2" in surveys["microvm"]
        # and run as a VM, the VM's own layer reads back the same
        vm = dsec.Sandbox.create(image=f"test/vm-pack-microvm:{tag}", kind="microvm", client=client, memory="192Mi")
        made.append(vm)
        assert vm.exec(SURVEY).stdout == surveys["microvm"]
    finally:
        for sb in made:
            sb.kill()
