"""tests/infra: lint and pure tests of the Ansible side, plus testinfra checks of provisioned hosts.

``test_node.py`` checks *provisioned lab hosts*; tests/lab/test_provision.py runs it against them
(with ``--hosts`` and ``DDPFAB_INFRA_EXPECT``). Collected on its own it would test the machine
pytest runs on, so it is only collected when that variable names what to expect.
"""

import os

collect_ignore = [] if os.environ.get("DDPFAB_INFRA_EXPECT") else ["test_node.py"]
