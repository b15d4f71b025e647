"""SIP through LiveKit: the inbound trunk and dispatch rule that send each call to this agent.

livekit-sip turns a call into a room; the dispatch rule puts each call in a room of its own and
dispatches the agent (AGENT_NAME) to it, so it arrives like any browser user. `voice-agent sip
setup` makes the trunk and the rule through livekit-api, and running it again changes nothing
but what the settings changed: both are found by name. livekit-server keeps them in Redis.
"""

from dataclasses import dataclass

from livekit import api
from livekit.protocol import sip as sip_proto

from agent.config import Settings

ROOM_PREFIX = "call-"  # each call's room: call-<caller>-<random>


@dataclass
class Provisioned:
    trunks: list[sip_proto.SIPInboundTrunkInfo]
    rules: list[sip_proto.SIPDispatchRuleInfo]


def trunk_name(settings: Settings) -> str:
    return f"{settings.agent_name} inbound"


def rule_name(settings: Settings) -> str:
    return f"{settings.agent_name} dispatch"


def livekit_api(settings: Settings) -> api.LiveKitAPI:
    if not settings.livekit_enabled:
        raise ValueError("SIP through LiveKit needs LIVEKIT_URL, LIVEKIT_API_KEY and LIVEKIT_API_SECRET")
    return api.LiveKitAPI(
        settings.livekit_url.replace("ws://", "http://").replace("wss://", "https://"),
        settings.livekit_api_key,
        settings.livekit_api_secret.get_secret_value(),
    )


def desired_trunk(settings: Settings, numbers: list[str]) -> sip_proto.SIPInboundTrunkInfo:
    """Calls to `numbers` (any number when empty) from SIP_ALLOWED_SOURCES, with SIP_USERNAME/SIP_PASSWORD when set."""
    sources = [s.strip() for s in settings.sip_allowed_sources.split(",") if s.strip()]
    return sip_proto.SIPInboundTrunkInfo(
        name=trunk_name(settings),
        numbers=numbers,
        allowed_addresses=sources,
        auth_username=settings.sip_username or "",
        auth_password=settings.sip_password.get_secret_value() if settings.sip_password else "",
    )


def desired_rule(settings: Settings, trunk_id: str) -> sip_proto.SIPDispatchRuleInfo:
    return sip_proto.SIPDispatchRuleInfo(
        name=rule_name(settings),
        trunk_ids=[trunk_id],
        rule=sip_proto.SIPDispatchRule(
            dispatch_rule_individual=sip_proto.SIPDispatchRuleIndividual(room_prefix=ROOM_PREFIX)
        ),
        room_config=api.RoomConfiguration(agents=[api.RoomAgentDispatch(agent_name=settings.agent_name)]),
    )


async def provisioned(lk: api.LiveKitAPI, settings: Settings) -> Provisioned:
    """This agent's trunks and rules (by name); other agents' are left alone."""
    trunks = (await lk.sip.list_inbound_trunk(sip_proto.ListSIPInboundTrunkRequest())).items
    rules = (await lk.sip.list_dispatch_rule(sip_proto.ListSIPDispatchRuleRequest())).items
    return Provisioned(
        trunks=[t for t in trunks if t.name == trunk_name(settings)],
        rules=[r for r in rules if r.name == rule_name(settings)],
    )


async def setup(settings: Settings, numbers: list[str]) -> Provisioned:
    """Exactly one trunk and one rule for this agent, as the settings say: made, or brought up to date."""
    async with livekit_api(settings) as lk:
        ours = await provisioned(lk, settings)
        trunk = desired_trunk(settings, numbers)
        if ours.trunks:
            trunk = await lk.sip.update_inbound_trunk(ours.trunks[0].sip_trunk_id, trunk)
        else:
            trunk = await lk.sip.create_inbound_trunk(sip_proto.CreateSIPInboundTrunkRequest(trunk=trunk))
        rule = desired_rule(settings, trunk.sip_trunk_id)
        if ours.rules:
            rule = await lk.sip.update_dispatch_rule(ours.rules[0].sip_dispatch_rule_id, rule)
        else:
            rule = await lk.sip.create_dispatch_rule(sip_proto.CreateSIPDispatchRuleRequest(dispatch_rule=rule))
        # Duplicates (two set-ups racing) would split calls between rules: keep the first only.
        for extra in ours.rules[1:]:
            await lk.sip.delete_dispatch_rule(sip_proto.DeleteSIPDispatchRuleRequest(sip_dispatch_rule_id=extra.sip_dispatch_rule_id))
        for extra in ours.trunks[1:]:
            await lk.sip.delete_trunk(sip_proto.DeleteSIPTrunkRequest(sip_trunk_id=extra.sip_trunk_id))
        return Provisioned(trunks=[trunk], rules=[rule])


async def list_provisioned(settings: Settings) -> Provisioned:
    async with livekit_api(settings) as lk:
        return await provisioned(lk, settings)


async def teardown(settings: Settings) -> Provisioned:
    """Delete this agent's trunks and rules; returns what was deleted."""
    async with livekit_api(settings) as lk:
        ours = await provisioned(lk, settings)
        for rule in ours.rules:
            await lk.sip.delete_dispatch_rule(sip_proto.DeleteSIPDispatchRuleRequest(sip_dispatch_rule_id=rule.sip_dispatch_rule_id))
        for trunk in ours.trunks:
            await lk.sip.delete_trunk(sip_proto.DeleteSIPTrunkRequest(sip_trunk_id=trunk.sip_trunk_id))
        return ours
