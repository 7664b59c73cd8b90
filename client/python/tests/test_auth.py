"""Token authentication, against a broker with a tokens file.

Runs when ``FELIX_AUTH_ADDR`` (that broker), ``FELIX_AUTH_TOKEN`` (a token
it lists) and ``FELIX_AUTH_PRINCIPAL`` (the principal the token names) are
set; skipped otherwise.
"""

import os
import unittest

import felix

from .support import fresh_stream

AUTH_ADDR = os.environ.get("FELIX_AUTH_ADDR")
AUTH_TOKEN = os.environ.get("FELIX_AUTH_TOKEN")
AUTH_PRINCIPAL = os.environ.get("FELIX_AUTH_PRINCIPAL")


@unittest.skipUnless(
    AUTH_ADDR and AUTH_TOKEN and AUTH_PRINCIPAL,
    "set FELIX_AUTH_ADDR, FELIX_AUTH_TOKEN and FELIX_AUTH_PRINCIPAL to test token auth",
)
class TokenAuthTest(unittest.TestCase):
    def test_a_listed_token_works_on_every_core(self) -> None:
        with felix.Client.connect(str(AUTH_ADDR), token=AUTH_TOKEN) as client:
            path = fresh_stream("auth")
            info = client.create_stream(path, 4)
            for shard in range(4):
                self.assertEqual(client.publish(path, shard, b"signed"), 0)
            self.assertEqual(client.connected_cores, sorted(set(info.placement)))
            self.assertEqual(client.read(path, 3, 0).records[0].payload, b"signed")
            client.delete_stream(path)

    def test_a_bad_token_is_unauthorized(self) -> None:
        with self.assertRaises(felix.Unauthorized) as caught:
            felix.Client.connect(str(AUTH_ADDR), token=str(AUTH_TOKEN) + "-wrong")
        self.assertEqual((caught.exception.code, caught.exception.number), ("unauthorized", 8))

    def test_no_token_is_unauthorized(self) -> None:
        with self.assertRaises(felix.Unauthorized):
            felix.Client.connect(str(AUTH_ADDR))
