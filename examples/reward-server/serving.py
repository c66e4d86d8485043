"""What the reference reward and environment servers share: who may call
them (client certificates, bearer tokens), and the flags for it (with
``--server-user``, whose work privileges.py does). The environment server
imports this module from ``../reward-server``, as it imports the sandbox.

Client authentication, as bapo's own services do it:

* ``--client-ca FILE`` (with ``--tls-cert/--tls-key``): mutual TLS. A
  client must present a certificate issued by a CA in FILE, or the TLS
  handshake fails. A certificate that names a SPIFFE ID
  (``spiffe://<trust domain>/<role>[/<name>]``, as the Helm chart's do)
  must name one of the server's client roles, else PERMISSION_DENIED.
* ``--token-file FILE``: bearer tokens in bapo's token-file format
  (``proto/src/tls/token.rs``): one ``<role> <secret>`` line per token,
  ``#`` comments and blank lines ignored; a line may hold
  ``sha256:<64 hex digits>`` instead of the secret, so that the server can
  check a token it does not know; secrets are at least 16 visible ASCII
  characters. A call must carry ``authorization: Bearer <secret>``
  matching a line of a client role (UNAUTHENTICATED when it carries none
  or one no line matches, PERMISSION_DENIED for a token of another role).
  Every line's SHA-256 is compared with the presented token's, each with
  ``hmac.compare_digest``; no message names a secret. Tokens travel only
  over TLS: the servers refuse ``--token-file`` without ``--tls-cert``.

Both together: a caller needs both.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Iterable, List, Optional, Sequence, Tuple

import grpc

log = logging.getLogger("bapo.serving")

MIN_SECRET_LEN = 16
KNOWN_ROLES = ("actor", "learner", "admin")


class TokenFileError(ValueError):
    """A token file that cannot be used; the message names the file and
    line, never a secret."""


def _visible_ascii(s: str) -> bool:
    return all(0x21 <= ord(c) <= 0x7E for c in s)


class TokenFile:
    """The parsed lines of a token file: (role, SHA-256 of the secret)."""

    def __init__(self, entries: List[Tuple[str, bytes]]):
        self.entries = entries

    def __repr__(self) -> str:  # never the digests
        return f"TokenFile(roles={[r for r, _ in self.entries]})"

    @classmethod
    def parse(cls, text: str, path: str = "tokens") -> "TokenFile":
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            words = line.split()
            where = f"{path}:{number}"
            if len(words) != 2:
                raise TokenFileError(f"{where}: expected `<role> <secret>`")
            role, secret = words
            if role not in KNOWN_ROLES:
                raise TokenFileError(f"{where}: unknown role {role!r} (known: {', '.join(KNOWN_ROLES)})")
            if secret.startswith("sha256:"):
                hexdigits = secret[len("sha256:"):]
                try:
                    digest = bytes.fromhex(hexdigits) if len(hexdigits) == 64 else b""
                except ValueError:
                    digest = b""
                if len(digest) != 32:
                    raise TokenFileError(f"{where}: sha256: must be followed by 64 hexadecimal digits")
                entries.append((role, digest))
                continue
            if len(secret) < MIN_SECRET_LEN or not _visible_ascii(secret):
                raise TokenFileError(
                    f"{where}: the {role} token must be at least {MIN_SECRET_LEN} visible ASCII characters")
            entries.append((role, hashlib.sha256(secret.encode("ascii")).digest()))
        if not entries:
            raise TokenFileError(f"{path}: no token in it")
        return cls(entries)

    @classmethod
    def load(cls, path: str) -> "TokenFile":
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenFileError(f"reading the token file {path}: {e}") from e
        return cls.parse(text, path)

    def verify(self, presented: str) -> Optional[str]:
        """The role of the line `presented` matches, or None. Every line is
        compared, each in constant time."""
        digest = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
        found = None
        for role, expected in self.entries:
            if hmac.compare_digest(expected, digest) and found is None:
                found = role
        return found


def bearer(value: str) -> Optional[str]:
    """The token of an ``authorization: Bearer <token>`` value."""
    scheme, sep, token = value.partition(" ")
    if not sep or scheme.lower() != "bearer":
        return None
    return token.strip()


def spiffe_role(auth_context) -> Optional[str]:
    """The role of the peer certificate's SPIFFE ID, "" when it names none
    (or there is no certificate)."""
    for key in ("peer_spiffe_id", "x509_subject_alternative_name", "peer_uri"):
        for value in auth_context.get(key, ()):
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            if text.startswith("spiffe://"):
                path = text[len("spiffe://"):].partition("/")[2]
                return path.partition("/")[0]
    return ""


def _refusing(handler, code: grpc.StatusCode, message: str):
    """A handler of the same kind as `handler` that only aborts."""

    def behavior(_request, context):
        context.abort(code, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _checking_certificate(handler, roles: Sequence[str]):
    """`handler`, but a caller whose certificate names a SPIFFE role not in
    `roles` is refused first."""

    def wrap(fn):
        def behavior(request, context):
            role = spiffe_role(context.auth_context())
            if role and role not in roles:
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"a certificate of role {role} may not call this server (roles: {', '.join(roles)})")
            return fn(request, context)
        return behavior

    kinds = {
        (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
        (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
        (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
        (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
    }
    attr, make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(wrap(getattr(handler, attr)), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class ClientAuth(grpc.ServerInterceptor):
    """Refuses every call that does not carry a bearer token of `roles`
    (when `tokens`), and every call whose certificate names another role
    (when `check_certificates`: under --client-ca)."""

    def __init__(self, roles: Sequence[str], tokens: Optional[TokenFile] = None,
                 check_certificates: bool = False):
        self.roles = tuple(roles)
        self.tokens = tokens
        self.check_certificates = check_certificates

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if self.tokens is not None:
            values = [v for k, v in (handler_call_details.invocation_metadata or ())
                      if k == "authorization"]
            token = bearer(values[0]) if len(values) == 1 and isinstance(values[0], str) else None
            if token is None:
                return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                                 "no bearer token: this server needs `authorization: Bearer <token>` "
                                 "with a token of its token file")
            role = self.tokens.verify(token)
            if role is None:
                return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                                 "the bearer token matches no token of the server's token file")
            if role not in self.roles:
                return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED,
                                 f"a token of role {role} may not call this server (roles: {', '.join(self.roles)})")
        if self.check_certificates:
            handler = _checking_certificate(handler, self.roles)
        return handler


# --- flags ----------------------------------------------------------------


def add_arguments(parser, unauthenticated_help: str) -> None:
    g = parser.add_argument_group("client authentication (docs: examples/reward-server/serving.py)")
    g.add_argument("--client-ca", metavar="FILE",
                   help="PEM CA bundle: require client certificates it issued (mutual TLS; "
                        "needs --tls-cert/--tls-key)")
    g.add_argument("--token-file", metavar="FILE",
                   help="bapo token file: require `authorization: Bearer <token>` of a client "
                        "role (needs --tls-cert/--tls-key: tokens only over TLS)")
    g.add_argument("--allow-unauthenticated", action="store_true", help=unauthenticated_help)
    parser.add_argument("--server-user", metavar="UID[:GID]",
                        help="started as root: serve as UID:GID instead, keeping only CAP_SETUID "
                             "and CAP_SETGID (to start sandboxed programs as their own users) and "
                             "the supplementary groups but root's")


def check_arguments(parser, args, refuse_unauthenticated: Optional[str]) -> None:
    """Refuses contradictory flags, and (when `refuse_unauthenticated`
    says why) serving without client authentication."""
    if (args.client_ca or args.token_file) and not args.tls_cert:
        which = "--client-ca" if args.client_ca else "--token-file"
        why = "client certificates are part of TLS" if args.client_ca else "bearer tokens only travel over TLS"
        parser.error(f"{which} needs --tls-cert and --tls-key ({why})")
    if refuse_unauthenticated and not (args.client_ca or args.token_file or args.allow_unauthenticated):
        parser.error(
            f"refusing to serve without client authentication: {refuse_unauthenticated}. "
            "Pass --client-ca FILE (client certificates) or --token-file FILE (bearer tokens), "
            "either with --tls-cert/--tls-key, or --allow-unauthenticated to serve anyone who "
            "reaches the port")


def authentication(args) -> Tuple[Optional[bytes], Optional[TokenFile]]:
    """(client CA PEM or None, TokenFile or None) from the flags."""
    ca = None
    if args.client_ca:
        with open(args.client_ca, "rb") as f:
            ca = f.read()
        if b"-----BEGIN CERTIFICATE-----" not in ca:
            raise ValueError(f"--client-ca {args.client_ca}: no PEM certificate in it")
    tokens = TokenFile.load(args.token_file) if args.token_file else None
    return ca, tokens


def describe(client_ca, tokens) -> str:
    parts = []
    if client_ca:
        parts.append("client certificates")
    if tokens:
        parts.append("bearer tokens")
    return " and ".join(parts) or "NO client authentication"


def credentials(tls: Tuple[bytes, bytes], client_ca: Optional[bytes]):
    """Server credentials: `tls` is (certificate chain, private key)."""
    if client_ca:
        return grpc.ssl_server_credentials([(tls[1], tls[0])], root_certificates=client_ca,
                                           require_client_auth=True)
    return grpc.ssl_server_credentials([(tls[1], tls[0])])


def interceptors(roles: Iterable[str], client_ca, tokens) -> list:
    if not (client_ca or tokens):
        return []
    return [ClientAuth(tuple(roles), tokens, check_certificates=bool(client_ca))]
